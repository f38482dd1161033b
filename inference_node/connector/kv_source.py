"""Where the worker role gets the fact KV its node cache misses, chosen once when the worker is built (`kv_source`):

- `FetchProcessKv` (serving): the node's fetch process (inference_node.fetch_process) runs the byte path
  (inference_node.kv_fetch.MemoryServiceKv) out of vLLM's engine process and hands each chunk's decoded heads over
  through shared memory; copied out into pinned memory where there is a GPU.
- `SyntheticKv` (speed runs only, `NodeSettings.synthetic_kv`): random KV of the right shape, so the engine side can
  be measured without a memory service.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from inference_node.connector.tensor_parallel import UNSHARDED, KvHeadShard
from inference_node.fetch_process import FetchProcessKv
from inference_node.kv_fetch import CachedKv
from inference_node.plan import ChunkLoad
from inference_node.settings import NodeSettings
from inferscale_kv.shape import KvShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class KvSource(Protocol):
    processes_started: int  # fetch processes started so far (0 for a source that runs none)
    durable_reads: int  # of the chunks fetched so far, those read from the memory service's durable tier

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype, *,
              user_token: str = "") -> list[CachedKv]:
        """Every chunk's KV (this rank's heads) in host memory in `dtype`, contiguous, in chunk order; raises
        (LookupError, CorruptKvBlob, KvFetchFailed, TimeoutError, ValueError, ...) if any chunk cannot be had (the
        request prefills it instead). Thread-safe: fetch threads call it. The caller (residency.KvResidency) checks
        each entry's shape and puts it in the node's tiers. `user_token`: the gateway's token of the request the
        chunks are fetched for, forwarded to a memory service that binds node reads to users."""
        ...

    def close(self) -> None:
        """Releases what the source holds (a fetch process); idempotent. Fetches fail afterwards."""
        ...


def kv_source(settings: NodeSettings, hf_config: PretrainedConfig, shard: KvHeadShard = UNSHARDED) -> KvSource:
    """The source the node's settings ask for, holding `shard`'s heads of the model's KV."""
    model_shape = KvShape.from_config(hf_config)
    if settings.synthetic_kv:
        return SyntheticKv(shard.of(model_shape))
    return FetchProcessKv(settings.memory_service, settings.fetch_timeout_s, shard.heads(model_shape.num_kv_heads),
                          shard.of(model_shape), durable_tier=settings.kv_durable_tier)


class SyntheticKv:
    def __init__(self, rank_shape: KvShape) -> None:
        self.rank_shape = rank_shape
        self.processes_started = 0
        self.durable_reads = 0

    def fetch(self, user_id: str, chunks: Sequence[ChunkLoad], dtype: torch.dtype, *,
              user_token: str = "") -> list[CachedKv]:
        return [self._random(chunk, dtype) for chunk in chunks]

    def close(self) -> None:
        pass

    def _random(self, chunk: ChunkLoad, dtype: torch.dtype) -> CachedKv:
        shape = self.rank_shape.of(len(chunk.token_ids))
        return CachedKv(torch.randn(shape, dtype=dtype) * 0.1, torch.randn(shape, dtype=dtype) * 0.1,
                        chunk.token_ids)
