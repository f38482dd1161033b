"""Query embeddings computed on the node's own device (`--embed-queries-locally`), with the memory service's
embedding model: RetrieveAndStage then carries the vector and the model's id, and the service skips its own
embedding (the bulk of its CPU per call)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from inferscale_kv.batching import MicroBatcher
from inferscale_kv.embedding_model import embedding_model_id, resolve_model_path

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

# Queries embedded together at most: the requests in flight of a busy node, in one model call.
MAX_QUERY_BATCH = 128


class LocalQueryEmbedder:
    """sentence-transformers on the node's device (CUDA when present), on a thread of its own (the API server's
    event loop never waits on the model); queries that arrive while a batch is embedded go together in the next one,
    so a node with a hundred requests in flight makes a few model calls, not a hundred in a row."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.model_id = ""
        self._encoder: SentenceTransformer | None = None
        self._queries = MicroBatcher(self._embed, ThreadPoolExecutor(max_workers=1,
                                                                     thread_name_prefix="node-query-embed"),
                                     MAX_QUERY_BATCH)

    def _loaded(self) -> SentenceTransformer:
        """The model, loaded on first use."""
        if self._encoder is None:
            import torch
            from sentence_transformers import SentenceTransformer

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self._encoder = SentenceTransformer(str(resolve_model_path(self.model)), device=device)
            self.model_id = embedding_model_id(self.model)
        return self._encoder

    def _embed(self, texts: list[str]) -> list[list[float]]:
        return self._loaded().encode(texts, batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True,
                                     show_progress_bar=False).tolist()

    async def embed(self, text: str) -> tuple[list[float], str]:
        """(the query's unit embedding, the model's id)."""
        vector = await self._queries.submit(text)
        return vector, self.model_id
