"""The serving benchmark's own logic: hit rates from counter deltas, connector phases, the speed-run model folder."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoTokenizer

from benchmarks.dummy_model import build_dummy_model
from benchmarks.serve import connector_phases, hit_rate
from benchmarks.synthetic_worker import SyntheticFactEncoder
from inferscale_kv.model_profile import build_model_profile
from precompute_worker.encoder import EncodingGroup, FactKey, FactSpec


def test_hit_rate_is_the_ratio_of_counter_deltas_and_none_without_lookups() -> None:
    before = {"node_cache_hits": 10, "node_cache_lookups": 20}
    assert hit_rate(before, {"node_cache_hits": 13, "node_cache_lookups": 24}) == 0.75
    assert hit_rate(before, before) is None


def test_connector_phases_take_only_warm_loads_of_the_requested_size(tmp_path) -> None:
    loads = [{"chunks": 11, "node_cache_misses": 0, "tokens": 200, "ms": 2.0, "stage_ms": 0.2, "compose_ms": 1.0,
              "write_ms": 0.8},
             {"chunks": 11, "node_cache_misses": 3, "tokens": 200, "ms": 9.0, "stage_ms": 7.0, "compose_ms": 1.0,
              "write_ms": 1.0},
             {"chunks": 51, "node_cache_misses": 0, "tokens": 900, "ms": 3.0, "stage_ms": 0.4, "compose_ms": 1.4,
              "write_ms": 1.2}]
    path = tmp_path / "loads.jsonl"
    path.write_text("".join(json.dumps(load) + "\n" for load in loads))
    assert connector_phases(path, 11) == {"loads": 1, "tokens_p50": 200, "ms_p50": 2.0, "stage_ms_p50": 0.2,
                                          "compose_ms_p50": 1.0, "write_ms_p50": 0.8}
    assert connector_phases(path, 21) is None
    assert connector_phases(tmp_path / "absent.jsonl", 11) is None


def test_dummy_model_folder_has_the_shape_a_real_tokenizer_and_a_profile(tiny_llama_dir, tmp_path) -> None:
    folder = build_dummy_model(tmp_path / "tiny", "llama-tiny", tiny_llama_dir, "bfloat16")
    config = AutoConfig.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (config.num_hidden_layers, config.num_key_value_heads, config.vocab_size) == (4, 2, len(tokenizer))
    assert build_model_profile(folder, tokenizer, "bfloat16", 0).profile_id.startswith("kvp-")


def test_synthetic_encoder_gives_every_fact_kv_of_the_model_shape(tiny_llama_dir, tmp_path) -> None:
    folder = build_dummy_model(tmp_path / "tiny", "llama-tiny", tiny_llama_dir, "bfloat16")
    encoder = SyntheticFactEncoder(AutoConfig.from_pretrained(folder), torch.bfloat16, 2048)
    specs = [FactSpec(FactKey("u", f"f{i}", 1), list(range(3 + i)), 0) for i in range(3)]
    encoded = encoder.encode([EncodingGroup([1, 2], specs[:2]), EncodingGroup([], specs[2:])])
    assert [fact.spec for fact in encoded] == specs
    assert [tuple(fact.keys.shape) for fact in encoded] == [(4, 3 + i, 2, 64) for i in range(3)]
    assert all(fact.values.dtype == torch.bfloat16 for fact in encoded)
