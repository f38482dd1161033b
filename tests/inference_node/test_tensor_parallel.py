"""Tensor-parallel fetches into the node cache on CPU: each simulated rank fetches a fact's KV from a real memory
service, keeps only its KV heads, and composes (RoPE to the final positions) exactly the TP=1 composition's slice of
those heads."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from inference_node.connector.compose import ChunkSlice, compose_prefix
from inference_node.connector.kv_source import kv_source
from inference_node.connector.node_cache import NodeKvCache
from inference_node.connector.residency import KvResidency
from inference_node.connector.tensor_parallel import UNSHARDED, KvHeadShard
from inference_node.plan import ChunkLoad
from inference_node.settings import NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.kv_key import KvKey
from inferscale_kv.rope import RotaryTables
from inferscale_kv.shape import KvShape
from tests.inference_node.conftest import random_kv, tiny_profile, upload_custom_kv
from tests.stacks import Users

user = Users(__name__)
USER = user("tp-user")
FACTS = ["Erin grows chillies on her balcony.", "Erin sails a small dinghy on Sundays."]


def test_a_rank_holds_an_even_contiguous_share_of_the_kv_heads() -> None:
    assert [KvHeadShard(rank, 2).heads(8) for rank in range(2)] == [slice(0, 4), slice(4, 8)]
    assert KvHeadShard(0, 1).heads(8) == slice(0, 8)


def test_with_more_ranks_than_kv_heads_each_head_is_replicated_on_consecutive_ranks() -> None:
    assert [KvHeadShard(rank, 8).heads(2) for rank in range(8)] == [slice(0, 1)] * 4 + [slice(1, 2)] * 4


def test_a_head_count_that_does_not_split_evenly_is_refused() -> None:
    with pytest.raises(ValueError, match="do not split"):
        KvHeadShard(0, 4).heads(6)
    with pytest.raises(ValueError, match="outside"):
        KvHeadShard(2, 2)


@pytest.fixture(scope="module")
def profile(tiny_llama_dir) -> pb.KvProfile:
    return tiny_profile(tiny_llama_dir)


@pytest.fixture(scope="module")
def staged_facts(node_stub, tiny_llama_dir, profile) -> list[ChunkLoad]:
    node_stub.IngestFacts(pb.IngestFactsRequest(user_id=USER, facts=[
        pb.FactInput(fact_id=f"f{i}", text=text) for i, text in enumerate(FACTS)]))
    node_stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=USER, query="Erin", profile=profile, node_id="tp"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    token_ids = {text: tokenizer(text)["input_ids"] for text in FACTS}
    upload_custom_kv(node_stub, profile, USER, lambda item: (*random_kv(len(token_ids[item.text]), 7 + len(item.text)),
                                                             token_ids[item.text]))
    retrieved = node_stub.RetrieveAndStage(pb.RetrieveAndStageRequest(user_id=USER, query="Erin", profile=profile,
                                                                       node_id="tp"))
    content = {fact.fact_id: fact.content_id for fact in retrieved.facts}
    chunks, offset = [], 0
    for i, text in enumerate(FACTS):
        key = KvKey(profile.profile_id, USER, f"f{i}", 1, content[f"f{i}"])
        chunks.append(ChunkLoad(key, tuple(token_ids[text]), offset))
        offset += len(token_ids[text])
    return chunks


def _residency(memory_service, model_dir, shard: KvHeadShard) -> KvResidency:
    settings = NodeSettings(memory_service=memory_service.address, node_id=f"tp-rank-{shard.rank}",
                            model_dir=str(model_dir))
    config = AutoConfig.from_pretrained(model_dir)
    return KvResidency(NodeKvCache(), NodeKvCache(), kv_source(settings, config, shard),
                       shard.of(KvShape.from_config(config)))


def test_each_rank_fetches_and_composes_exactly_its_heads_of_the_tp1_composition(
        node_memory_service, tiny_llama_dir, staged_facts, profile) -> None:
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    tables = RotaryTables.from_config(config, 256)
    cpu = torch.device("cpu")

    def composed(shard: KvHeadShard) -> tuple[torch.Tensor, torch.Tensor]:
        residency = _residency(node_memory_service, tiny_llama_dir, shard)
        assert residency.fetch(USER, staged_facts, cpu, torch.float32, None).from_source == len(staged_facts)
        slices = [ChunkSlice(e.keys, e.values, 0, len(e.token_ids)) for e in residency.resident(staged_facts)]
        return compose_prefix(slices, 5, tables.cos.float(), tables.sin.float(), config.num_hidden_layers,
                              fused=False)

    full_keys, full_values = composed(UNSHARDED)
    assert full_keys.shape[2] == config.num_key_value_heads == 2
    for rank in range(2):
        heads = KvHeadShard(rank, 2).heads(config.num_key_value_heads)
        keys, values = composed(KvHeadShard(rank, 2))
        assert keys.shape[2] == 1
        assert torch.equal(keys, full_keys[:, :, heads]) and torch.equal(values, full_values[:, :, heads])


def test_a_rank_caches_only_its_share_of_the_bytes(node_memory_service, tiny_llama_dir, staged_facts,
                                                   profile) -> None:
    whole = _residency(node_memory_service, tiny_llama_dir, UNSHARDED)
    half = _residency(node_memory_service, tiny_llama_dir, KvHeadShard(1, 2))
    for residency in (whole, half):
        residency.fetch(USER, staged_facts, torch.device("cpu"), torch.float32, None)
    assert half.device_tier.bytes_used * 2 == whole.device_tier.bytes_used > 0
