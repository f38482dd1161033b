"""The real worker against the real service: every fact of every user gets exact, usable KV."""

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.conversation import load_conversation
from harness.memory_service import MemoryServiceProcess
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc
from inferscale_kv.blob import decode_kv_blob
from inferscale_kv.layout import fact_token_ids, memory_header_ids
from inferscale_kv.model_profile import build_model_profile
from inferscale_kv.rope import RotaryTables, apply_rope
from precompute_worker.worker import profile_message
from tests.conftest import own_memory_service, run_worker
from tests.stacks import Users

user = Users(__name__)
USERS = (user("e2e-maya"), user("e2e-maya-twin"))


def _retrieve_all(stub, user_id: str, profile: pb.KvProfile) -> list[pb.RetrievedFact]:
    return list(stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
        user_id=user_id, query="Maya", top_k=100, profile=profile, node_id="test-node")).facts)


@pytest.fixture(scope="module")
def own_service(tmp_path_factory) -> Iterator[MemoryServiceProcess]:
    """A service of this test's own: a worker of a new profile computes KV for every fact its service holds, and the
    shared one holds every other module's."""
    with own_memory_service(tmp_path_factory, "smollm2-service") as service:
        yield service


def test_worker_stores_kv_for_every_fact_of_two_users_with_smollm2(own_service, smollm2_dir) -> None:
    with own_service.channel() as channel:
        _check_smollm2_worker(own_service, memory_pb2_grpc.MemoryServiceStub(channel), smollm2_dir)


def _check_smollm2_worker(memory_service, stub, smollm2_dir) -> None:
    for user_id in USERS:
        conversation = load_conversation(user_id=user_id)
        stub.IngestTurns(pb.IngestTurnsRequest(user_id=user_id, turns=conversation.turns))
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=conversation.facts))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    profile = profile_message(build_model_profile(smollm2_dir, tokenizer, "float32", context_window=5))

    run_worker(memory_service, smollm2_dir, "--max-facts", "8", "--context-window", "5")
    (worker,) = stub.GetStats(pb.GetStatsRequest()).workers  # reported with each lease: its capacity, no GPU here
    assert worker.profile_id == profile.profile_id and worker.facts_per_second > 0 and worker.device.name == ""

    for user_id in USERS:
        facts = _retrieve_all(stub, user_id, profile)
        assert len(facts) == len(load_conversation().facts)
        assert all(fact.kv_ready for fact in facts)
        for fact in facts:
            assert list(fact.token_ids) == fact_token_ids(tokenizer, fact.text)
        fetched = list(stub.FetchKv(pb.FetchKvRequest(
            profile_id=profile.profile_id, user_id=user_id,
            facts=[pb.FactRef(fact_id=f.fact_id, version=f.version, content_id=f.content_id) for f in facts])))
        for fact, reply in zip(facts, fetched, strict=True):
            kv = decode_kv_blob(reply.blob)
            assert kv.keys.shape == (30, len(fact.token_ids), 3, 64)
            assert kv.header.user_id == user_id and kv.header.fact_id == fact.fact_id
    stats = next(p for p in stub.GetStats(pb.GetStatsRequest()).profiles if p.profile_id == profile.profile_id)
    assert (stats.queued, stats.leased, stats.failed) == (0, 0, 0)


def test_kv_through_worker_and_service_reproduces_plain_prefill(memory_service, stub, tiny_llama_dir) -> None:
    user_id = user("e2e-exact")
    stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=[
        pb.FactInput(fact_id="bees", text="Ana keeps bees on the roof of her house.")]))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    profile = profile_message(build_model_profile(tiny_llama_dir, tokenizer, "float32", context_window=0))

    run_worker(memory_service, tiny_llama_dir, "--max-facts", "8", "--context-window", "0")

    (fact,) = _retrieve_all(stub, user_id, profile)
    (reply,) = stub.FetchKv(pb.FetchKvRequest(profile_id=profile.profile_id, user_id=user_id,
                                              facts=[pb.FactRef(fact_id="bees", version=1,
                                                                content_id=fact.content_id)]))
    kv = decode_kv_blob(reply.blob)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    header = memory_header_ids(tokenizer)
    with torch.no_grad():
        cache = model(torch.tensor([header + list(fact.token_ids)]), use_cache=True).past_key_values
    tables = RotaryTables.from_model(model, 256)
    rotated = apply_rope(kv.keys, len(header), tables.cos, tables.sin)
    for layer_index, layer in enumerate(cache.layers):
        plain_keys = layer.keys[0].transpose(0, 1)[len(header):]
        plain_values = layer.values[0].transpose(0, 1)[len(header):]
        assert (rotated[layer_index] - plain_keys).abs().max() <= 1e-4
        assert (kv.values[layer_index] - plain_values).abs().max() <= 1e-4
