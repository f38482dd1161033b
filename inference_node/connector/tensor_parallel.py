"""Which KV heads a tensor-parallel rank holds, so that a fetch into the node cache keeps only that rank's slice of
each fact's KV.

vLLM shards attention by KV head: with `total` KV heads and `size` ranks, rank r holds heads
[r * total / size, (r + 1) * total / size) when total >= size, and otherwise the single head r // (size / total),
each head then replicated on size / total ranks. RoPE acts on each head alone, so composing a rank's slice equals
slicing the composition of all heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from inferscale_kv.shape import KvShape


@dataclass(frozen=True)
class KvHeadShard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside [0, {self.size})")

    def heads(self, total: int) -> slice:
        """This rank's KV heads out of `total`, as a slice of the head dimension."""
        if total >= self.size:
            if total % self.size:
                raise ValueError(f"{total} KV heads do not split over {self.size} tensor-parallel ranks")
            per_rank = total // self.size
            return slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        if self.size % total:
            raise ValueError(f"{self.size} tensor-parallel ranks do not replicate {total} KV heads evenly")
        head = self.rank // (self.size // total)
        return slice(head, head + 1)

    def of(self, shape: KvShape) -> KvShape:
        """The KV shape this rank holds of the model's `shape`."""
        heads = self.heads(shape.num_kv_heads)
        return KvShape(shape.num_layers, heads.stop - heads.start, shape.head_dim)


UNSHARDED = KvHeadShard(rank=0, size=1)


def current_shard(tensor_parallel_size: int) -> KvHeadShard:
    """The calling vLLM worker's shard (its tensor-parallel group must be initialized when size > 1)."""
    if tensor_parallel_size == 1:
        return UNSHARDED
    return KvHeadShard(rank=get_tensor_model_parallel_rank(), size=tensor_parallel_size)
