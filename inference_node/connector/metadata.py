"""What the scheduler role sends the worker role, once per step (vLLM pickles it to every worker): the loads it
decided and the node-cache evictions to apply before them."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from inference_node.plan import ChunkLoad
from inferscale_kv.kv_key import KvKey


@dataclass(frozen=True)
class LoadSpec:
    """One request's load: write the chunks' KV at prompt positions [start, end) into its blocks."""

    request_id: str
    user_id: str
    chunks: tuple[ChunkLoad, ...]
    start: int  # first prompt position to write (tokens before it are in vLLM's prefix cache)
    end: int  # one past the last position to write
    block_ids: tuple[int, ...]
    load_async: bool = False


@dataclass
class InferScaleConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    evictions: tuple[KvKey, ...] = ()  # node-cache entries to drop before this step's loads
