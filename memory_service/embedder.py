"""Sentence embeddings, computed in batches on worker threads so the event loop never blocks."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from inferscale_kv.batching import MicroBatcher
from inferscale_kv.embedding_model import embedding_model_id, resolve_model_path
from memory_service.onnx_encoder import OnnxSentenceEncoder


class TorchSentenceEncoder:
    """sentence-transformers on torch: any model layout, any torch device."""

    def __init__(self, model_dir: str, device: str, batch_size: int, threads: int) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(threads)
        self._model = SentenceTransformer(model_dir, device=device)
        self._batch_size = batch_size
        dim = self._model.get_embedding_dimension()
        if dim is None:
            raise ValueError(f"{model_dir}: the model does not declare its embedding dimension")
        self.dim = int(dim)

    def encode(self, texts: list[str]) -> np.ndarray:
        return self._model.encode(texts, batch_size=self._batch_size, normalize_embeddings=True,
                                  convert_to_numpy=True, show_progress_bar=False)


INGEST_NICE = 10
"""Nice value of ingest's embedding threads. Queries are on the request path of every answer; ingest is not. On a
busy CPU the scheduler gives a nice-10 thread about a tenth of a nice-0 one's share, so an ingest batch no longer
takes cores from the queries arriving while it runs (and has them all when no query does)."""


def _lower_thread_priority() -> None:
    """Lowers the calling thread's priority. On Linux nice is per thread and inherited by the threads it starts,
    so an ONNX Runtime session created from this thread computes at this priority too."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), INGEST_NICE)


class Embedder:
    """Unit-normalized float32 embeddings; `load` must finish before `embed` or `embed_query` is called.

    Backends: "onnx" (ONNX Runtime, CPU; exported once into `cache_dir`) or "torch" (sentence-transformers). Both
    give the same vectors to float rounding, so the stored embeddings do not depend on the backend. Queries and
    ingest run on threads of their own; with onnx each has its own session, ingest's at lower priority
    (INGEST_NICE). torch shares one model, whose intra-op threads keep their priority."""

    def __init__(self, model: str, device: str, batch_size: int, threads: int, backend: str = "onnx",
                 cache_dir: Path | None = None, observe_query_batch: Callable[[int], None] = lambda size: None) -> None:
        if backend == "onnx" and cache_dir is None:
            raise ValueError("the onnx backend needs a cache_dir for its exported model")
        self.model_name = model
        self.backend = backend
        self._device = device
        self._batch_size = batch_size
        self._threads = threads
        self._cache_dir = cache_dir
        self._query_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-query")
        self._ingest_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-ingest",
                                                   initializer=_lower_thread_priority)
        self._query_encoder: OnnxSentenceEncoder | TorchSentenceEncoder | None = None
        self._ingest_encoder: OnnxSentenceEncoder | TorchSentenceEncoder | None = None
        self.dim = 0
        self.model_id = ""  # inferscale_kv.embedding_model.embedding_model_id, once loaded
        self._queries: MicroBatcher[str, np.ndarray] = MicroBatcher(self._embed_queries, self._query_executor,
                                                                    batch_size, observe_query_batch)

    def _load_blocking(self) -> OnnxSentenceEncoder | TorchSentenceEncoder:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model_dir = resolve_model_path(self.model_name)
        if self.backend == "onnx":
            assert self._cache_dir is not None
            return OnnxSentenceEncoder.load(model_dir, self._cache_dir, self._threads)
        return TorchSentenceEncoder(str(model_dir), self._device, self._batch_size, self._threads)

    async def load(self) -> None:
        loop = asyncio.get_running_loop()
        self._query_encoder = await loop.run_in_executor(self._query_executor, self._load_blocking)
        self.dim = self._query_encoder.dim
        self.model_id = await loop.run_in_executor(self._query_executor, embedding_model_id, self.model_name)
        if self.backend == "onnx":  # the export is cached by now; this session's threads start at ingest's priority
            self._ingest_encoder = await loop.run_in_executor(self._ingest_executor, self._load_blocking)
        else:
            self._ingest_encoder = self._query_encoder

    def _embed_blocking(self, encoder: OnnxSentenceEncoder | TorchSentenceEncoder | None,
                        texts: list[str]) -> np.ndarray:
        assert encoder is not None, "Embedder.load() was not awaited"
        order = sorted(range(len(texts)), key=lambda index: len(texts[index]))  # batches of like lengths pad less
        ordered = [texts[index] for index in order]
        chunks = [encoder.encode(ordered[start:start + self._batch_size])
                  for start in range(0, len(ordered), self._batch_size)]
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        vectors[order] = np.concatenate(chunks)
        return vectors

    async def embed(self, texts: list[str]) -> np.ndarray:
        """Embeds texts (facts being ingested) into a [len(texts), dim] float32 array of unit vectors."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return await asyncio.get_running_loop().run_in_executor(
            self._ingest_executor, self._embed_blocking, self._ingest_encoder, texts)

    async def embed_query(self, text: str) -> np.ndarray:
        """One query's [dim] embedding, batched with the queries that arrive meanwhile (inferscale_kv.batching)."""
        return await self._queries.submit(text)

    def _embed_queries(self, texts: list[str]) -> np.ndarray:
        return self._embed_blocking(self._query_encoder, texts)

    def close(self) -> None:
        for executor in (self._query_executor, self._ingest_executor):
            executor.shutdown(wait=False, cancel_futures=True)
