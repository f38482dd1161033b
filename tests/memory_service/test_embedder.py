"""Embeddings: concurrent queries share model calls and get the vectors they would get alone; ingest's
embedding threads run at lower priority than the queries'."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from harness.memory_service import shared_embedding_cache_dir
from inferscale_kv.embedding_model import DEFAULT_EMBEDDING_MODEL
from memory_service.embedder import INGEST_NICE, Embedder

QUERIES = [f"what did I say about topic {i}?" for i in range(24)] + ["", "日本語の質問 🙂"]


@pytest.fixture(scope="module")
def embedder():
    sizes: list[int] = []
    model = Embedder(DEFAULT_EMBEDDING_MODEL, "cpu", batch_size=16, threads=1, cache_dir=shared_embedding_cache_dir(),
                     observe_query_batch=sizes.append)
    asyncio.run(model.load())
    model.batch_sizes = sizes
    yield model
    model.close()


def test_concurrent_queries_are_batched_and_match_their_single_embeddings(embedder) -> None:
    async def run() -> list[np.ndarray]:
        return await asyncio.gather(*(embedder.embed_query(q) for q in QUERIES))

    embedder.batch_sizes.clear()
    batched = asyncio.run(run())
    alone = asyncio.run(embedder.embed(QUERIES))
    assert sum(embedder.batch_sizes) == len(QUERIES) and max(embedder.batch_sizes) == 16
    assert len(embedder.batch_sizes) < len(QUERIES)
    np.testing.assert_allclose(np.stack(batched), alone, atol=1e-5)


def test_a_failed_batch_fails_its_queries_and_later_queries_still_embed(embedder, monkeypatch) -> None:
    real = embedder._embed_blocking

    def fail_on_poison(encoder, texts: list[str]) -> np.ndarray:
        if "poison" in texts:
            raise RuntimeError("embedding failed")
        return real(encoder, texts)

    monkeypatch.setattr(embedder, "_embed_blocking", fail_on_poison)

    async def run():
        first = await asyncio.gather(embedder.embed_query("poison"), return_exceptions=True)
        return first, await embedder.embed_query("a later query")

    (failure,), later = asyncio.run(run())
    assert isinstance(failure, RuntimeError)
    assert later.shape == (embedder.dim,)


def test_a_cancelled_query_does_not_break_its_batch(embedder) -> None:
    async def run():
        cancelled = asyncio.ensure_future(embedder.embed_query("cancel me"))
        kept = asyncio.ensure_future(embedder.embed_query("keep me"))
        await asyncio.sleep(0)
        cancelled.cancel()
        return await kept

    assert asyncio.run(run()).shape == (embedder.dim,)


def _thread_nice() -> dict[int, tuple[str, int]]:
    """tid -> (name, nice) of this process's threads (Linux: field 19 of /proc/self/task/<tid>/stat)."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    nice = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        nice[tid] = (names.get(tid, "unnamed"), int(stat[stat.rindex(")") + 2:].split()[16]))
    return nice


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")
def test_ingest_embeds_on_lower_priority_threads_and_queries_do_not() -> None:
    before = set(_thread_nice())
    model = Embedder(DEFAULT_EMBEDDING_MODEL, "cpu", batch_size=16, threads=2, cache_dir=shared_embedding_cache_dir())
    try:
        asyncio.run(model.load())
        asyncio.run(model.embed(["a fact"] * 8))
        asyncio.run(model.embed_query("a query"))
        started = [named for tid, named in _thread_nice().items() if tid not in before]
    finally:
        model.close()
    assert [nice for name, nice in started if name.startswith("embed-ingest")] == [INGEST_NICE], started
    assert [nice for name, nice in started if name.startswith("embed-query")] == [0], started
    # the ingest session's intra-op thread (unnamed, started by ONNX Runtime) inherits the priority
    assert [nice for name, nice in started].count(INGEST_NICE) == 2, started
