"""The asyncio client: the synchronous client's calls (inferscale_client.client) as coroutines on grpc.aio, for apps
that serve from an event loop."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_client import requests
from inferscale_client.client import Progress
from inferscale_client.errors import InferScaleError
from inferscale_client.health import HEALTH_CHECK, health_request, health_status
from inferscale_client.settings import MAX_DELETE_IDS, MAX_FACTS_PER_CALL, MAX_TURNS_PER_CALL, ClientSettings


class AsyncMemoryClient:
    """As MemoryClient, its calls awaited; `async with` closes its channel. Create it inside the running loop."""

    def __init__(self, settings: ClientSettings | None = None, **overrides: Any) -> None:
        self.settings = settings or ClientSettings.from_env(**overrides)
        credentials = self.settings.credentials()
        options = self.settings.channel_options()
        self._channel = (grpc.aio.secure_channel(self.settings.memory_service, credentials, options=options)
                         if credentials else grpc.aio.insecure_channel(self.settings.memory_service, options=options))
        self._stub = memory_pb2_grpc.MemoryServiceStub(self._channel)

    async def __aenter__(self) -> AsyncMemoryClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Callable[..., Any], request: Any) -> Any:
        request_id = uuid.uuid4().hex
        try:
            return await method(request, timeout=self.settings.timeout_s, metadata=self.settings.metadata(request_id))
        except grpc.RpcError as error:
            raise InferScaleError.from_rpc_error(error, request_id) from None

    async def add_facts(self, user_id: str, facts: Iterable[requests.FactLike], *, batch_size: int = MAX_FACTS_PER_CALL,
                        progress: Progress | None = None) -> list[pb.IngestedFact]:
        """MemoryClient.add_facts."""
        ingest = requests.FactIngest(facts, batch_size, progress)
        while (batch := ingest.next_batch()) is not None:
            try:
                ingest.answered(batch, await self._call(self._stub.IngestFacts,
                                                        pb.IngestFactsRequest(user_id=user_id, facts=batch)))
            except InferScaleError as error:
                ingest.refused(batch, error)
        return ingest.results

    async def add_turns(self, user_id: str, turns: Iterable[requests.TurnLike], *,
                        batch_size: int = MAX_TURNS_PER_CALL, progress: Progress | None = None) -> int:
        """MemoryClient.add_turns."""
        written = 0
        for batch in requests.batches((requests.turn(value) for value in turns), batch_size):
            response = await self._call(self._stub.IngestTurns, pb.IngestTurnsRequest(user_id=user_id, turns=batch))
            written += response.turns_written
            if progress is not None:
                progress(len(batch))
        return written

    async def search(self, user_id: str, query: str, *, top_k: int = 0, retrieval: str = "") -> list[pb.ScoredFact]:
        """MemoryClient.search."""
        response = await self._call(self._stub.SearchFacts, pb.SearchFactsRequest(
            user_id=user_id, query=query, top_k=top_k, retrieval=requests.RETRIEVAL_MODES[retrieval]))
        return list(response.facts)

    async def list_facts(self, user_id: str, *, page_size: int = 0) -> AsyncIterator[pb.Fact]:
        """MemoryClient.list_facts."""
        token = ""
        while True:
            page = await self._call(self._stub.ListFacts, pb.ListFactsRequest(user_id=user_id, page_size=page_size,
                                                                              page_token=token))
            for fact in page.facts:
                yield fact
            token = page.next_page_token
            if not token:
                return

    async def delete_facts(self, user_id: str, fact_ids: Iterable[str]) -> pb.DeleteFactsResponse:
        """MemoryClient.delete_facts."""
        if isinstance(fact_ids, str):
            raise TypeError("fact_ids: a list of fact ids, not one string")
        total = pb.DeleteFactsResponse()
        for chunk in requests.chunks(list(fact_ids), MAX_DELETE_IDS):
            response = await self._call(self._stub.DeleteFacts, pb.DeleteFactsRequest(user_id=user_id,
                                                                                      fact_ids=chunk))
            total.facts_deleted += response.facts_deleted
            total.not_found_fact_ids.extend(response.not_found_fact_ids)
        return total

    async def delete_user(self, user_id: str) -> pb.DeleteUserResponse:
        """MemoryClient.delete_user."""
        return await self._call(self._stub.DeleteUser, pb.DeleteUserRequest(user_id=user_id))

    async def stats(self, user_id: str = "") -> pb.GetStatsResponse:
        """MemoryClient.stats."""
        return await self._call(self._stub.GetStats, pb.GetStatsRequest(user_id=user_id))

    async def health(self) -> str:
        """MemoryClient.health."""
        check = self._channel.unary_unary(HEALTH_CHECK, request_serializer=health_request,
                                          response_deserializer=health_status)
        return await self._call(check, "")
