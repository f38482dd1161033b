"""The worker role on its own (CPU, stand-ins for vLLM's config and attention layers), with the KV source and load
timer the node's settings choose at construction: synthetic KV of this rank's shape, and one JSON line per load
staged from the node cache."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from inference_node.connector.kv_source import MemoryServiceKv, SyntheticKv, kv_source
from inference_node.connector.load_timer import UNTIMED, JsonLinesLoadTimer, load_timer
from inference_node.connector.metadata import InferScaleConnectorMetadata, LoadSpec
from inference_node.connector.tensor_parallel import KvHeadShard
from inference_node.connector.worker import InferScaleWorker
from inference_node.plan import ChunkLoad
from inference_node.settings import NodeSettings
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, KvKey
from inferscale_kv.shape import KvShape

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 16, 4
HF_CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                        num_hidden_layers=LAYERS, intermediate_size=128, vocab_size=128)
CHUNKS = (ChunkLoad(KvKey("p", HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, "a" * 32), (1, 2, 3), 0),
          ChunkLoad(KvKey("p", "u1", "f", 1, "b" * 32), (10, 11, 12, 13), 3))
RECORD_FIELDS = ["request_id", "tokens", "chunks", "ms", "node_cache_misses", "stage_ms", "compose_ms", "write_ms"]


def _settings(**overrides) -> NodeSettings:
    return NodeSettings(memory_service="127.0.0.1:1", node_id="n", model_dir="-", profile={"profile_id": "p"},
                        **overrides)


class _AttentionLayer:
    """An attention layer as the worker sees it: a paged cache and the backend's cache update (recorded)."""

    def __init__(self) -> None:
        self.kv_cache = torch.zeros(8, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
        self.num_kv_heads, self.head_size = KV_HEADS, HEAD_DIM
        self.written: list[tuple[int, ...]] = []
        self.impl = SimpleNamespace(do_kv_cache_update=self._update)

    def _update(self, layer, keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor,
                slots: torch.Tensor) -> None:
        assert keys.shape == values.shape == (len(slots), KV_HEADS, HEAD_DIM)
        self.written.append(tuple(slots.tolist()))


@pytest.fixture
def layers() -> dict[str, _AttentionLayer]:
    return {f"model.layers.{index}.self_attn.attn": _AttentionLayer() for index in range(LAYERS)}


def _worker(settings: NodeSettings) -> InferScaleWorker:
    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
                                  model_config=SimpleNamespace(hf_config=HF_CONFIG, dtype=torch.float32,
                                                               max_model_len=64),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return InferScaleWorker.from_settings(vllm_config, settings)


def _load(worker: InferScaleWorker, layers: dict, request_id: str, load_async: bool) -> set[str] | None:
    spec = LoadSpec(request_id, "u1", CHUNKS, 0, 7, (5, 6), load_async)
    worker.start_load_kv(InferScaleConnectorMetadata(loads=[spec]), SimpleNamespace(no_compile_layers=layers))
    finished, deadline = worker.get_finished(), time.monotonic() + 30
    while load_async and finished is None and time.monotonic() < deadline:  # an async fetch: on a thread
        time.sleep(0.01)
        finished = worker.get_finished()
    return finished


def test_the_settings_choose_the_kv_source_and_the_load_timer_once(tmp_path: Path) -> None:
    assert isinstance(kv_source(_settings(), HF_CONFIG), MemoryServiceKv)
    synthetic = kv_source(_settings(synthetic_kv=True), HF_CONFIG, KvHeadShard(1, 2))
    assert isinstance(synthetic, SyntheticKv) and synthetic.rank_shape == KvShape(LAYERS, 1, HEAD_DIM)
    (entry,) = synthetic.fetch("u1", CHUNKS[1:], torch.device("cpu"), torch.bfloat16, None)
    assert entry.keys.shape == (LAYERS, 4, 1, HEAD_DIM) and entry.keys.dtype == torch.bfloat16
    assert entry.token_ids == CHUNKS[1].token_ids
    assert load_timer(_settings()) is UNTIMED
    timer = load_timer(_settings(load_stats_path=str(tmp_path / "loads.jsonl")))
    assert isinstance(timer, JsonLinesLoadTimer) and timer.path == str(tmp_path / "loads.jsonl")


def test_a_timed_worker_records_each_load_staged_from_the_node_cache(tmp_path: Path, layers) -> None:
    stats_path = tmp_path / "loads.jsonl"
    worker = _worker(_settings(synthetic_kv=True, load_stats_path=str(stats_path)))
    assert _load(worker, layers, "cold", load_async=True) == {"cold"}  # fetched (synthetic): not recorded
    assert _load(worker, layers, "sync", load_async=False) is None  # written before the forward
    assert _load(worker, layers, "warm", load_async=True) == {"warm"}  # resident: staged at once
    assert worker.take_failed_blocks() == set()
    records = [json.loads(line) for line in stats_path.read_text().splitlines()]
    assert [record["request_id"] for record in records] == ["sync", "warm"]
    for record in records:
        assert list(record) == RECORD_FIELDS
        assert (record["tokens"], record["chunks"], record["node_cache_misses"]) == (7, 2, 0)
        assert record["ms"] == pytest.approx(record["stage_ms"] + record["compose_ms"] + record["write_ms"])
        assert min(record["stage_ms"], record["compose_ms"], record["write_ms"]) >= 0
    slots = (20, 21, 22, 23, 24, 25, 26)  # positions 0..6 in blocks 5 and 6
    assert all(layer.written == [slots] * 3 for layer in layers.values())
    stats = worker.take_stats()
    assert stats is not None and {name: stats.data[name] for name in (
        "loads", "async_loads", "facts_fetched", "node_cache_hits", "tokens_loaded", "load_failures")} == {
        "loads": 3, "async_loads": 2, "facts_fetched": 2, "node_cache_hits": 4, "tokens_loaded": 21,
        "load_failures": 0}


def test_an_untimed_worker_writes_no_records(tmp_path: Path, layers, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    worker = _worker(_settings(synthetic_kv=True))
    assert _load(worker, layers, "cold", load_async=True) == {"cold"}
    assert _load(worker, layers, "sync", load_async=False) is None
    assert list(tmp_path.iterdir()) == []
    assert all(len(layer.written) == 2 for layer in layers.values())


def test_a_synchronous_load_of_chunks_the_node_cache_lacks_fails_without_fetching(layers) -> None:
    worker = _worker(_settings(synthetic_kv=True))
    assert _load(worker, layers, "sync", load_async=False) is None
    assert worker.take_failed_blocks() == {5, 6}
    stats = worker.take_stats()
    assert stats is not None and (stats.data["sync_misses"], stats.data["facts_fetched"]) == (1, 0)
    assert all(layer.written == [] for layer in layers.values())
