"""The node's RetrieveAndStage calls under concurrency (inference_node.retrieval.RetrievalBatcher) against a real
memory service: calls that arrive together share RetrieveAndStageBatch RPCs, each answered with its own user's
facts or its own status, and a service without the batch method gets single calls."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from harness.router import metric_total, prometheus_samples
from inference_node.retrieval import RetrievalBatcher
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from tests.inference_node.conftest import tiny_profile
from tests.stacks import Users

user = Users(__name__)
USERS = [user(f"batched-{index}") for index in range(8)]


def _marker(user_id: str) -> str:
    return f"{user_id} keeps a red kayak."


@pytest.fixture(scope="module")
def profile(stub, tiny_llama_dir) -> pb.KvProfile:
    for user_id in USERS:
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
            pb.FactInput(fact_id="marker", text=_marker(user_id)),
            pb.FactInput(fact_id="other", text="The weather was mild that week.")]))
    return tiny_profile(tiny_llama_dir)


def _rpcs(service, method: str) -> float:
    samples = prometheus_samples(f"http://127.0.0.1:{service.metrics_port}/metrics")
    return metric_total(samples, "inferscale_rpc_requests_total", f'method="{method}"')


def _request(user_id: str, profile: pb.KvProfile) -> pb.RetrieveAndStageRequest:
    return pb.RetrieveAndStageRequest(user_id=user_id, query="kayak", top_k=2, profile=profile, node_id="node-b")


async def _call_all(address: str, requests: list[pb.RetrieveAndStageRequest],
                    stub_of=memory_pb2_grpc.MemoryServiceStub) -> list[pb.RetrieveAndStageResponse | BaseException]:
    async with grpc.aio.insecure_channel(address) as channel:
        batcher = RetrievalBatcher(stub_of(channel), (), 30.0, in_flight=2)
        return await asyncio.gather(*(batcher.call(request) for request in requests), return_exceptions=True)


def test_concurrent_calls_share_batches_and_each_gets_its_own_users_facts(memory_service, profile) -> None:
    requests = [_request(user_id, profile) for user_id in USERS * 4]
    before = {method: _rpcs(memory_service, method) for method in ("RetrieveAndStage", "RetrieveAndStageBatch")}
    answers = asyncio.run(_call_all(memory_service.address, requests))
    sent = {method: _rpcs(memory_service, method) - before[method] for method in before}
    assert sent["RetrieveAndStageBatch"] >= 1 and sum(sent.values()) < len(requests), sent
    for request, answer in zip(requests, answers, strict=True):
        assert isinstance(answer, pb.RetrieveAndStageResponse), answer
        texts = [fact.text for fact in answer.facts]
        assert texts[0] == _marker(request.user_id)
        assert not any("kayak" in text for text in texts[1:]), texts  # no other user's marker


def test_a_call_the_service_refuses_fails_alone_with_its_own_status(memory_service, profile) -> None:
    requests = [_request(USERS[0], profile), _request("not a valid id", profile), _request(USERS[1], profile)]
    answers = asyncio.run(_call_all(memory_service.address, requests * 3))
    for index, answer in enumerate(answers):
        if index % 3 == 1:
            assert isinstance(answer, grpc.aio.AioRpcError), answer
            assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT and answer.details().startswith("user_id:")
        else:
            assert isinstance(answer, pb.RetrieveAndStageResponse), answer
            assert answer.facts[0].text == _marker(requests[index % 3].user_id)


class _EarlierRelease(memory_pb2_grpc.MemoryServiceStub):
    """A memory service of a release without RetrieveAndStageBatch: the method is UNIMPLEMENTED."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)
        self.RetrieveAndStageBatch = channel.unary_unary(
            "/inferscale.v1.MemoryService/NoSuchMethod",
            request_serializer=pb.RetrieveAndStageBatchRequest.SerializeToString,
            response_deserializer=pb.RetrieveAndStageBatchResponse.FromString)


def test_a_service_without_the_batch_method_gets_single_calls(memory_service, profile) -> None:
    requests = [_request(user_id, profile) for user_id in USERS * 2]
    answers = asyncio.run(_call_all(memory_service.address, requests, _EarlierRelease))
    for request, answer in zip(requests, answers, strict=True):
        assert isinstance(answer, pb.RetrieveAndStageResponse), answer
        assert answer.facts[0].text == _marker(request.user_id)


class _Recording:
    """A memory service stand-in that answers every call after `delay_s`, recording each RPC's number of calls."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sizes: list[int] = []

    async def RetrieveAndStage(self, request, timeout, metadata):
        self.sizes.append(1)
        await asyncio.sleep(self.delay_s)
        return pb.RetrieveAndStageResponse()

    async def RetrieveAndStageBatch(self, request, timeout, metadata):
        self.sizes.append(len(request.calls))
        await asyncio.sleep(self.delay_s)
        return pb.RetrieveAndStageBatchResponse(results=[pb.RetrieveAndStageResult() for _ in request.calls])


def test_a_batch_holds_at_most_max_batch_facts() -> None:
    service = _Recording(0.01)

    async def run() -> None:
        batcher = RetrievalBatcher(service, (), 10.0, in_flight=1)  # type: ignore[arg-type]
        await asyncio.gather(*(batcher.call(pb.RetrieveAndStageRequest(user_id=f"u{i}", top_k=1000))
                               for i in range(6)))

    asyncio.run(run())
    assert service.sizes == [1, 2, 2, 1]  # 2 x 1000 facts fit MAX_BATCH_FACTS (2048), 3 do not


def test_each_call_fails_at_its_own_deadline_sent_or_waiting() -> None:
    service = _Recording(30.0)  # never answers in time

    async def run() -> tuple[list[BaseException | pb.RetrieveAndStageResponse], float]:
        batcher = RetrievalBatcher(service, (), 0.3, in_flight=1)  # type: ignore[arg-type]
        started = time.perf_counter()
        answers = await asyncio.gather(*(batcher.call(pb.RetrieveAndStageRequest(user_id=f"u{i}", top_k=5))
                                         for i in range(3)), return_exceptions=True)
        return answers, time.perf_counter() - started

    answers, seconds = asyncio.run(run())
    assert seconds < 5, seconds
    assert all(isinstance(answer, grpc.aio.AioRpcError) and answer.code() == grpc.StatusCode.DEADLINE_EXCEEDED
               for answer in answers), answers
    assert service.sizes == [1]  # the two waiting calls expired before a slot came free
