"""The worker role on its own (CPU, stand-ins for vLLM's config and attention layers): prefetches on fetch threads,
checked before they enter the node cache, loads from the node cache alone, and the KV source and load timer the
node's settings choose at construction (synthetic KV of this rank's shape; one JSON line per load)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from inference_node.connector.kv_source import SyntheticKv, kv_source
from inference_node.connector.load_timer import UNTIMED, JsonLinesLoadTimer, load_timer
from inference_node.connector.metadata import InferScaleConnectorMetadata, LoadSpec, PrefetchReport, PrefetchSpec
from inference_node.connector.tensor_parallel import UNSHARDED, KvHeadShard
from inference_node.connector.worker import InferScaleWorker
from inference_node.fetch_process import FetchProcessKv
from inference_node.kv_fetch import CachedKv
from inference_node.plan import ChunkLoad
from inference_node.settings import NodeSettings
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, HEADER_VERSION, KvKey
from inferscale_kv.shape import KvShape

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 16, 4
HF_CONFIG = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                        num_hidden_layers=LAYERS, intermediate_size=128, vocab_size=128)
CHUNKS = (ChunkLoad(KvKey("p", HEADER_OWNER, HEADER_FACT_ID, HEADER_VERSION, "a" * 32), (1, 2, 3), 0),
          ChunkLoad(KvKey("p", "u1", "f", 1, "b" * 32), (10, 11, 12, 13), 3))
RECORD_FIELDS = ["request_id", "tokens", "chunks", "ms", "stage_ms", "compose_ms", "write_ms", "loads_in_step"]


def _settings(**overrides) -> NodeSettings:
    return NodeSettings(memory_service="127.0.0.1:1", node_id="n", model_dir="-", profile={"profile_id": "p"},
                        **overrides)


class _AttentionLayer:
    """An attention layer as the worker sees it: a paged cache and the backend's cache update (recorded, and
    written slot by slot)."""

    def __init__(self) -> None:
        self.kv_cache = torch.full((16, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM), float("nan"))
        self.num_kv_heads, self.head_size = KV_HEADS, HEAD_DIM
        self.written: list[tuple[int, ...]] = []
        self.impl = SimpleNamespace(do_kv_cache_update=self._update)

    def _update(self, layer, keys: torch.Tensor, values: torch.Tensor, cache: torch.Tensor,
                slots: torch.Tensor) -> None:
        assert keys.shape == values.shape == (len(slots), KV_HEADS, HEAD_DIM)
        self.written.append(tuple(slots.tolist()))
        for token, slot in enumerate(slots.tolist()):
            cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE, :HEAD_DIM] = keys[token]
            cache[slot // BLOCK_SIZE, :, slot % BLOCK_SIZE, HEAD_DIM:] = values[token]


@pytest.fixture
def layers() -> dict[str, _AttentionLayer]:
    return {f"model.layers.{index}.self_attn.attn": _AttentionLayer() for index in range(LAYERS)}


def _worker(settings: NodeSettings) -> InferScaleWorker:
    vllm_config: Any = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
                                  model_config=SimpleNamespace(hf_config=HF_CONFIG, dtype=torch.float32,
                                                               max_model_len=64),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1))
    return InferScaleWorker.from_settings(vllm_config, settings)


def _forward_context(layers: dict) -> Any:
    """vLLM's forward context as the worker role reads it."""
    return SimpleNamespace(no_compile_layers=layers)


def _prefetch(worker: InferScaleWorker, layers: dict, chunks=CHUNKS) -> PrefetchReport:
    """Starts a prefetch of `chunks` in a step's metadata, then polls the worker's report as later steps do."""
    metadata = InferScaleConnectorMetadata(prefetches=[PrefetchSpec("u1", chunks)])
    worker.start_load_kv(metadata, _forward_context(layers))
    deadline = time.monotonic() + 30
    while (report := worker.build_worker_meta()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert report is not None
    return report


def _load(worker: InferScaleWorker, layers: dict, request_id: str) -> None:
    spec = LoadSpec(request_id, "u1", CHUNKS, 0, 7, (5, 6))
    worker.start_load_kv(InferScaleConnectorMetadata(loads=[spec]), _forward_context(layers))


def test_the_settings_choose_the_kv_source_and_the_load_timer_once(tmp_path: Path) -> None:
    serving = kv_source(_settings(), HF_CONFIG, KvHeadShard(1, 2))
    assert isinstance(serving, FetchProcessKv) and serving.rank_shape == KvShape(LAYERS, 1, HEAD_DIM)
    serving.close()
    synthetic = kv_source(_settings(synthetic_kv=True), HF_CONFIG, KvHeadShard(1, 2))
    assert isinstance(synthetic, SyntheticKv) and synthetic.rank_shape == KvShape(LAYERS, 1, HEAD_DIM)
    (entry,) = synthetic.fetch("u1", CHUNKS[1:], torch.bfloat16)
    assert entry.keys.shape == (LAYERS, 4, 1, HEAD_DIM) and entry.keys.dtype == torch.bfloat16
    assert entry.token_ids == CHUNKS[1].token_ids
    assert load_timer(_settings()) is UNTIMED
    timer = load_timer(_settings(load_stats_path=str(tmp_path / "loads.jsonl")))
    assert isinstance(timer, JsonLinesLoadTimer) and timer.path == str(tmp_path / "loads.jsonl")


def test_a_timed_worker_records_each_load(tmp_path: Path, layers) -> None:
    stats_path = tmp_path / "loads.jsonl"
    worker = _worker(_settings(synthetic_kv=True, load_stats_path=str(stats_path)))
    report = _prefetch(worker, layers)  # fetched (synthetic) on a fetch thread: not a load
    assert report.fetched == Counter(chunk.key for chunk in CHUNKS) and not report.failed
    _load(worker, layers, "first")  # written before the forward, from the node cache
    _load(worker, layers, "second")
    assert worker.take_failed_blocks() == set()
    records = [json.loads(line) for line in stats_path.read_text().splitlines()]
    assert [record["request_id"] for record in records] == ["first", "second"]
    for record in records:
        assert list(record) == RECORD_FIELDS
        assert (record["tokens"], record["chunks"]) == (7, 2)
        assert record["ms"] == pytest.approx(record["stage_ms"] + record["compose_ms"] + record["write_ms"])
        assert min(record["stage_ms"], record["compose_ms"], record["write_ms"]) >= 0
    slots = (20, 21, 22, 23, 24, 25, 26)  # positions 0..6 in blocks 5 and 6
    assert all(layer.written == [slots] * 2 for layer in layers.values())
    stats = worker.take_stats()
    assert stats is not None and {name: stats.data[name] for name in (
        "loads", "facts_fetched", "tokens_loaded", "sync_misses")} == {
        "loads": 2, "facts_fetched": 2, "tokens_loaded": 14, "sync_misses": 0}


def test_an_untimed_worker_writes_no_records(tmp_path: Path, layers, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    worker = _worker(_settings(synthetic_kv=True))
    _prefetch(worker, layers)
    _load(worker, layers, "sync")
    assert list(tmp_path.iterdir()) == []
    assert all(len(layer.written) == 1 for layer in layers.values())


def test_a_load_of_chunks_the_node_cache_lacks_fails_without_fetching(layers) -> None:
    worker = _worker(_settings(synthetic_kv=True))
    _load(worker, layers, "sync")
    assert worker.take_failed_blocks() == {5, 6}
    stats = worker.take_stats()
    assert stats is not None and (stats.data["sync_misses"], stats.data["facts_fetched"]) == (1, 0)
    assert all(layer.written == [] for layer in layers.values())
    assert worker.build_worker_meta() is None  # nothing was fetched


class _Source:
    """A KV source that records the threads it is called on and the user tokens it is given, and gives what `make`
    returns."""

    def __init__(self, make) -> None:
        self.make, self.threads, self.user_tokens = make, list[str](), list[str]()
        self.processes_started = self.durable_reads = 0

    def fetch(self, user_id, chunks, dtype, *, user_token=""):
        self.threads.append(threading.current_thread().name)
        self.user_tokens.append(user_token)
        return self.make(chunks)

    def close(self) -> None:
        pass


def test_the_fetch_processes_a_source_started_and_its_durable_reads_are_counted_once_each() -> None:
    source = _Source(lambda chunks: [])
    worker = _worker_with(source)
    assert worker.take_stats() is None
    source.processes_started, source.durable_reads = 1, 5
    stats = worker.take_stats()
    assert stats is not None and (stats.data["fetch_processes_started"], stats.data["durable_tier_reads"]) == (1, 5)
    assert worker.take_stats() is None
    source.processes_started, source.durable_reads = 3, 12
    stats = worker.take_stats()
    assert stats is not None and (stats.data["fetch_processes_started"], stats.data["durable_tier_reads"]) == (2, 7)


def _worker_with(source: _Source, shard: KvHeadShard = UNSHARDED) -> InferScaleWorker:
    vllm_config: Any = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE, cache_dtype="auto"),
                                  model_config=SimpleNamespace(hf_config=HF_CONFIG, dtype=torch.float32,
                                                               max_model_len=64),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=shard.size))
    return InferScaleWorker(vllm_config, source, UNTIMED, shard)


def test_a_prefetch_that_waits_for_a_fetch_thread_past_its_start_time_fails_without_fetching(layers) -> None:
    """A backlog of fetches nobody waits for any more would make every later cold request wait out its deadline:
    a prefetch no thread could start within its `start_within_s` is reported failed (its reservation goes) unfetched."""
    release = threading.Event()
    synthetic = SyntheticKv(KvShape(LAYERS, KV_HEADS, HEAD_DIM))

    def slow(chunks):
        release.wait(10)
        return synthetic.fetch("u1", chunks, torch.float32)

    source = _Source(slow)
    worker = _worker_with(source)
    busy = [PrefetchSpec("u1", (chunk,)) for chunk in CHUNKS]  # one per fetch thread
    late = PrefetchSpec("u2", (ChunkLoad(KvKey("p", "u2", "g", 1, "c" * 32), (20, 21), 3),), start_within_s=0.05)
    worker.start_load_kv(InferScaleConnectorMetadata(prefetches=[*busy, late]), _forward_context(layers))
    time.sleep(0.3)
    release.set()
    reports = PrefetchReport()
    deadline = time.monotonic() + 30
    while sum(reports.fetched.values()) + sum(reports.failed.values()) < 3 and time.monotonic() < deadline:
        if (report := worker.build_worker_meta()) is not None:
            reports.fetched.update(report.fetched)
            reports.failed.update(report.failed)
        time.sleep(0.01)
    assert reports.fetched == Counter(chunk.key for chunk in CHUNKS)
    assert reports.failed == Counter([late.chunks[0].key])
    assert len(source.threads) == 2  # the late one never reached the source


def test_prefetches_run_on_fetch_threads_and_a_failed_one_puts_nothing_in_the_node_cache(layers) -> None:
    def refuse(chunks):
        raise LookupError("memory service unreachable")

    failing = _Source(refuse)
    worker = _worker_with(failing)
    report = _prefetch(worker, layers)
    assert report.failed == Counter(chunk.key for chunk in CHUNKS) and not report.fetched
    assert failing.threads and all(name.startswith("inferscale-fetch") for name in failing.threads)
    _load(worker, layers, "r1")  # were it declared anyway (a defect): refused, never fetched on the engine thread
    assert worker.take_failed_blocks() == {5, 6} and len(failing.threads) == 1


@pytest.mark.parametrize("wrong", ["heads", "dtype", "tokens"])
def test_a_prefetched_entry_of_another_shape_dtype_or_tokens_fails_the_prefetch(layers, wrong) -> None:
    def make(chunks):
        entries = []
        for chunk in chunks:
            heads, dtype, tokens = KV_HEADS, torch.float32, chunk.token_ids
            if wrong == "heads":
                heads = 1
            elif wrong == "dtype":
                dtype = torch.bfloat16
            else:
                tokens = tuple(token + 1 for token in tokens)
            shape = (LAYERS, len(tokens), heads, HEAD_DIM)
            entries.append(CachedKv(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), tokens))
        return entries

    worker = _worker_with(_Source(make))
    report = _prefetch(worker, layers)
    assert report.failed and not report.fetched
    _load(worker, layers, "r1")
    assert worker.take_failed_blocks() == {5, 6}  # nothing of it entered the node cache


def test_a_load_is_counted_once_per_node_not_once_per_rank(layers) -> None:
    """vLLM sums the ranks' stats: loads and tokens loaded come from the first rank alone (loads/prompt-token ratios
    on the dashboards stay right under tensor parallelism); a missing chunk is counted by the rank that missed it."""
    for shard, loads in ((KvHeadShard(0, 2), 1), (KvHeadShard(1, 2), 0)):
        worker = _worker_with(_Source(lambda chunks: []), shard)
        _load(worker, layers, "r1")  # nothing resident: a sync miss on this rank
        stats = worker.take_stats()
        assert stats is not None and (stats.data["loads"], stats.data["sync_misses"]) == (loads, 1)


def test_each_rank_checks_its_own_head_shard(layers) -> None:
    synthetic_half = SyntheticKv(KvHeadShard(1, 2).of(KvShape.from_config(HF_CONFIG)))
    worker = _worker_with(_Source(lambda chunks: synthetic_half.fetch("u1", chunks, torch.float32)), KvHeadShard(1, 2))
    assert _prefetch(worker, layers).fetched
    full = _worker_with(_Source(lambda chunks: synthetic_half.fetch("u1", chunks, torch.float32)))
    assert _prefetch(full, layers).failed  # a rank holding every head refuses half of them


def test_a_prefetch_hands_its_requests_user_token_to_the_source(layers) -> None:
    """The gateway's token of the request travels with its prefetch (and a warm-up's) to the KV source, which
    forwards it with FetchKv to a service that binds node reads to users."""
    synthetic = SyntheticKv(KvShape(LAYERS, KV_HEADS, HEAD_DIM))
    source = _Source(lambda chunks: synthetic.fetch("u1", chunks, torch.float32))
    worker = _worker_with(source)
    keys = frozenset(chunk.key for chunk in CHUNKS[1:])
    worker.start_load_kv(InferScaleConnectorMetadata(prefetches=[
        PrefetchSpec("u1", CHUNKS[:1], user_token="token-a"),
        PrefetchSpec("u1", CHUNKS[1:], keep_on_host=keys, to_device=False, user_token="token-b")]),
        _forward_context(layers))
    deadline = time.monotonic() + 30
    while len(source.user_tokens) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(source.user_tokens) == ["token-a", "token-b"]


def test_a_chunk_evicted_from_the_device_tier_comes_back_from_the_host_tier_not_the_source(layers) -> None:
    """Device -> host -> device on one rank: a chunk the directory kept on the host is copied back after its device
    eviction, without asking the source; a host eviction sends the next prefetch to the source again."""
    synthetic = SyntheticKv(KvShape(LAYERS, KV_HEADS, HEAD_DIM))
    source = _Source(lambda chunks: synthetic.fetch("u1", chunks, torch.float32))
    worker = _worker_with(source)
    keys = frozenset(chunk.key for chunk in CHUNKS)
    context = _forward_context(layers)
    worker.start_load_kv(InferScaleConnectorMetadata(prefetches=[PrefetchSpec("u1", CHUNKS, keep_on_host=keys)]),
                         context)
    assert _report_of(worker).fetched and len(source.threads) == 1
    worker.start_load_kv(InferScaleConnectorMetadata(evictions=tuple(keys), prefetches=[PrefetchSpec("u1", CHUNKS)]),
                         context)
    assert _report_of(worker).fetched and len(source.threads) == 1  # from the host tier
    stats = worker.take_stats()
    assert stats is not None and (stats.data["facts_fetched"], stats.data["host_tier_hits"]) == (2, 2)
    _load(worker, layers, "r1")
    assert worker.take_failed_blocks() == set()
    worker.start_load_kv(InferScaleConnectorMetadata(evictions=tuple(keys), host_evictions=tuple(keys),
                                                     prefetches=[PrefetchSpec("u1", CHUNKS)]), context)
    assert _report_of(worker).fetched and len(source.threads) == 2  # gone from both tiers: from the source


def test_a_promotion_copies_host_tier_chunks_into_the_device_tier_before_the_steps_loads(layers) -> None:
    """Host -> device in the step that loads them: the step's promotions are copied before its loads (which then
    write), even when the same step evicts them from the host tier; counted as host-tier hits with their bytes, and
    their bandwidth reported to the miss policy. A promotion the host tier lacks fails its load (a defect)."""
    synthetic = SyntheticKv(KvShape(LAYERS, KV_HEADS, HEAD_DIM))
    source = _Source(lambda chunks: synthetic.fetch("u1", chunks, torch.float32))
    worker = _worker_with(source)
    keys = tuple(chunk.key for chunk in CHUNKS)
    worker.start_load_kv(InferScaleConnectorMetadata(prefetches=[
        PrefetchSpec("u1", CHUNKS, keep_on_host=frozenset(keys), to_device=False)]), _forward_context(layers))
    _report_of(worker)
    worker.take_stats()
    spec = LoadSpec("r1", "u1", CHUNKS, 0, 7, (5, 6))
    worker.start_load_kv(InferScaleConnectorMetadata(promotions=CHUNKS, host_evictions=keys, loads=[spec]),
                         _forward_context(layers))
    assert worker.take_failed_blocks() == set() and len(source.threads) == 1
    assert all(layer.written for layer in layers.values())
    report = _report_of(worker)
    nbytes = sum(2 * LAYERS * KV_HEADS * HEAD_DIM * 4 * len(chunk.token_ids) for chunk in CHUNKS)
    assert report.transfer_bytes == Counter(host=nbytes) and report.transfer_micros["host"] > 0
    stats = worker.take_stats()
    assert stats is not None and (stats.data["host_tier_hits"], stats.data["host_bytes_copied"]) == (2, nbytes)
    worker.start_load_kv(InferScaleConnectorMetadata(evictions=keys, promotions=CHUNKS, loads=[spec]),
                         _forward_context(layers))
    assert worker.take_failed_blocks() == {5, 6}  # evicted from the host tier above: nothing to copy


def test_a_warm_up_puts_chunks_in_the_host_tier_only(layers) -> None:
    synthetic = SyntheticKv(KvShape(LAYERS, KV_HEADS, HEAD_DIM))
    source = _Source(lambda chunks: synthetic.fetch("u1", chunks, torch.float32))
    worker = _worker_with(source)
    keys = frozenset(chunk.key for chunk in CHUNKS)
    worker.start_load_kv(InferScaleConnectorMetadata(prefetches=[
        PrefetchSpec("u1", CHUNKS, keep_on_host=keys, to_device=False)]), _forward_context(layers))
    report = _report_of(worker)
    assert report.warmed == Counter(keys) and not report.fetched
    assert not report.transfer_bytes  # a warm-up's transfer is not a bandwidth the miss policy weighs
    _load(worker, layers, "r1")  # not in the device tier: a declared load would be a defect
    assert worker.take_failed_blocks() == {5, 6}
    worker.start_load_kv(InferScaleConnectorMetadata(prefetches=[PrefetchSpec("u1", CHUNKS)]),
                         _forward_context(layers))
    assert _report_of(worker).fetched and len(source.threads) == 1  # then one copy away


def _report_of(worker: InferScaleWorker) -> PrefetchReport:
    deadline = time.monotonic() + 30
    while (report := worker.build_worker_meta()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert report is not None
    return report


def test_a_load_of_no_chunks_fails_its_blocks(layers) -> None:
    """What the scheduler sends for an allocation it never answered: its blocks are reported failed (vLLM fails the
    request) rather than read as whatever they held."""
    worker = _worker(_settings(synthetic_kv=True))
    spec = LoadSpec("r1", "u1", (), 0, 7, (5, 6))
    worker.start_load_kv(InferScaleConnectorMetadata(loads=[spec]), _forward_context(layers))
    assert worker.take_failed_blocks() == {5, 6}
    assert all(layer.written == [] for layer in layers.values())


def test_the_loads_of_a_step_are_written_together_with_the_bytes_each_gets_alone_and_one_failing_fails_alone(
        layers) -> None:
    """Four loads admitted in one step (a whole one, one starting inside a chunk after a prefix-cache hit, one whose
    chunks are not resident, one naming a block outside the cache): one cache update per layer for the two that can
    load, each token in the slot and with the bytes a load written alone puts there; the others fail their own
    blocks only."""
    worker = _worker(_settings(synthetic_kv=True))
    _prefetch(worker, layers)
    missing = (ChunkLoad(KvKey("p", "u2", "g", 1, "c" * 32), (20, 21), 3),)
    together = [LoadSpec("whole", "u1", CHUNKS, 0, 7, (5, 6)), LoadSpec("tail", "u1", CHUNKS, 3, 7, (1, 2)),
                LoadSpec("absent", "u2", (CHUNKS[0], *missing), 0, 5, (3, 4)),
                LoadSpec("outside", "u1", CHUNKS, 0, 7, (99, 15))]  # a block past the cache's 16
    worker.start_load_kv(InferScaleConnectorMetadata(loads=together), _forward_context(layers))
    assert worker.take_failed_blocks() == {3, 4, 99, 15}
    assert all(layer.written == [(20, 21, 22, 23, 24, 25, 26, 7, 8, 9, 10)] for layer in layers.values())
    for alone in (LoadSpec("whole", "u1", CHUNKS, 0, 7, (9, 10)), LoadSpec("tail", "u1", CHUNKS, 3, 7, (11, 12))):
        worker.start_load_kv(InferScaleConnectorMetadata(loads=[alone]), _forward_context(layers))
    assert worker.take_failed_blocks() == set()
    for layer in layers.values():
        cache = layer.kv_cache
        assert _same(cache[5:7], cache[9:11])  # positions 0..6 (position 7 never written: NaN in both)
        assert _same(cache[1, :, 3], cache[11, :, 3]) and _same(cache[2, :, :3], cache[12, :, :3])
        assert cache[1, :, :3].isnan().all() and cache[3:5].isnan().all() and cache[15].isnan().all()


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-equal, NaN (never written) where the other is NaN."""
    return torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
