"""The synchronous client: every app- and operator-facing RPC of the memory service, with the address, token, TLS,
deadlines, retries and request ids of `ClientSettings`; failures raise InferScaleError."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_client import requests
from inferscale_client.errors import InferScaleError
from inferscale_client.health import HEALTH_CHECK, health_request, health_status
from inferscale_client.settings import MAX_DELETE_IDS, MAX_FACTS_PER_CALL, MAX_TURNS_PER_CALL, ClientSettings

Progress = Callable[[int], None]  # called with the items each finished call took


class MemoryClient:
    """`MemoryClient(settings)` or `MemoryClient(memory_service=..., token=...)` (the rest from INFERSCALE_*
    variables); a context manager that closes its channel."""

    def __init__(self, settings: ClientSettings | None = None, **overrides: Any) -> None:
        self.settings = settings or ClientSettings.from_env(**overrides)
        credentials = self.settings.credentials()
        options = self.settings.channel_options()
        self._channel = (grpc.secure_channel(self.settings.memory_service, credentials, options=options)
                         if credentials else grpc.insecure_channel(self.settings.memory_service, options=options))
        self._stub = memory_pb2_grpc.MemoryServiceStub(self._channel)

    def __enter__(self) -> MemoryClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Callable[..., Any], request: Any) -> Any:
        request_id = uuid.uuid4().hex
        try:
            return method(request, timeout=self.settings.timeout_s, metadata=self.settings.metadata(request_id))
        except grpc.RpcError as error:
            raise InferScaleError.from_rpc_error(error, request_id) from None

    def add_facts(self, user_id: str, facts: Iterable[requests.FactLike], *, batch_size: int = MAX_FACTS_PER_CALL,
                  progress: Progress | None = None) -> list[pb.IngestedFact]:
        """Stores (or updates, by fact_id) the user's facts, in as many calls as the service's limits need; each
        fact's outcome, in order. A call the service refuses raises, the facts of earlier calls staying stored."""
        ingest = requests.FactIngest(facts, batch_size, progress)
        while (batch := ingest.next_batch()) is not None:
            try:
                ingest.answered(batch, self._call(self._stub.IngestFacts,
                                                  pb.IngestFactsRequest(user_id=user_id, facts=batch)))
            except InferScaleError as error:
                ingest.refused(batch, error)
        return ingest.results

    def add_turns(self, user_id: str, turns: Iterable[requests.TurnLike], *, batch_size: int = MAX_TURNS_PER_CALL,
                  progress: Progress | None = None) -> int:
        """Stores (or rewrites, by turn_id) the user's conversation turns; the turns written."""
        written = 0
        for batch in requests.batches((requests.turn(value) for value in turns), batch_size):
            written += self._call(self._stub.IngestTurns, pb.IngestTurnsRequest(user_id=user_id, turns=batch)
                                  ).turns_written
            if progress is not None:
                progress(len(batch))
        return written

    def search(self, user_id: str, query: str, *, top_k: int = 0, retrieval: str = "") -> list[pb.ScoredFact]:
        """The user's facts best matching `query`, best first (top_k 0: the service's default; retrieval "vector",
        "keyword", "hybrid", or "": the service's default)."""
        return list(self._call(self._stub.SearchFacts, pb.SearchFactsRequest(
            user_id=user_id, query=query, top_k=top_k, retrieval=requests.RETRIEVAL_MODES[retrieval])).facts)

    def list_facts(self, user_id: str, *, page_size: int = 0) -> Iterator[pb.Fact]:
        """Every fact of the user, page by page (page_size 0: the service's default)."""
        token = ""
        while True:
            page = self._call(self._stub.ListFacts, pb.ListFactsRequest(user_id=user_id, page_size=page_size,
                                                                        page_token=token))
            yield from page.facts
            token = page.next_page_token
            if not token:
                return

    def delete_facts(self, user_id: str, fact_ids: Iterable[str]) -> pb.DeleteFactsResponse:
        """Deletes the facts (and their KV); how many were, and the ids not found."""
        if isinstance(fact_ids, str):
            raise TypeError("fact_ids: a list of fact ids, not one string")
        total = pb.DeleteFactsResponse()
        for chunk in requests.chunks(list(fact_ids), MAX_DELETE_IDS):
            response = self._call(self._stub.DeleteFacts, pb.DeleteFactsRequest(user_id=user_id, fact_ids=chunk))
            total.facts_deleted += response.facts_deleted
            total.not_found_fact_ids.extend(response.not_found_fact_ids)
        return total

    def delete_user(self, user_id: str) -> pb.DeleteUserResponse:
        """Deletes everything stored of the user (NOT_FOUND when nothing is)."""
        return self._call(self._stub.DeleteUser, pb.DeleteUserRequest(user_id=user_id))

    def stats(self, user_id: str = "") -> pb.GetStatsResponse:
        """The service's figures (a tenant's credential must name one of its users)."""
        return self._call(self._stub.GetStats, pb.GetStatsRequest(user_id=user_id))

    def health(self) -> str:
        """The service's grpc.health.v1 status: SERVING once it is ready."""
        check = self._channel.unary_unary(HEALTH_CHECK, request_serializer=health_request,
                                          response_deserializer=health_status)
        return self._call(check, "")

