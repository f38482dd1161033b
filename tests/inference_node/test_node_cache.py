"""The scheduler's node-cache directory (what is resident, what is being fetched, what leaves) and the worker's
cache."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from inference_node.connector.compose import ChunkSlice
from inference_node.connector.metadata import PrefetchReport
from inference_node.connector.node_cache import NodeCacheDirectory, NodeKvCache
from inference_node.kv_fetch import CachedKv
from inference_node.plan import ChunkLoad
from inferscale_kv.kv_key import KvKey


def _key(fact: int) -> KvKey:
    return KvKey("kvp-p", "u", f"f{fact}", 1, f"{fact:032x}")


def _chunk(fact: int, tokens: int = 10) -> ChunkLoad:
    return ChunkLoad(_key(fact), tuple(range(fact, fact + tokens)), 0)


def _report(*facts: int, failed: bool = False, ranks: int = 1) -> PrefetchReport:
    counts = Counter({_key(fact): ranks for fact in facts})
    return PrefetchReport(failed=counts) if failed else PrefetchReport(fetched=counts)


def _fetched(directory: NodeCacheDirectory, *facts: int) -> None:
    assert directory.prefetch("u", [_chunk(f) for f in facts], now=0.0, wait_s=1.0)
    directory.settle(_report(*facts))


def test_a_chunk_is_resident_only_once_every_rank_fetched_it() -> None:
    """Regression (first for async loads): the hint recorded chunks when their load was sent (also in-flight and
    failed ones)."""
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10, ranks=2)
    assert directory.prefetch("u", [_chunk(0)], now=0.0, wait_s=1.0)
    assert [spec.chunks for spec in directory.take_prefetches()] == [(_chunk(0),)]
    assert directory.fetch_id(_key(0)) is not None and not directory.is_resident(_chunk(0))
    directory.settle(_report(0))  # one rank of two
    assert not directory.is_resident(_chunk(0))
    directory.settle(_report(0))
    assert directory.is_resident(_chunk(0)) and not directory.fetch_id(_key(0)) is not None
    assert not directory.is_resident(_chunk(0, tokens=9))  # the key with other token ids is not this chunk


def test_a_chunk_one_rank_failed_is_evicted_from_every_rank() -> None:
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10, ranks=2)
    assert directory.prefetch("u", [_chunk(0)], now=0.0, wait_s=1.0)
    directory.settle(PrefetchReport(fetched=Counter({_key(0): 1}), failed=Counter({_key(0): 1})))
    assert not directory.is_resident(_chunk(0)) and not directory.fetch_id(_key(0)) is not None
    assert directory.take_evictions() == (_key(0),) and directory.bytes_used == 0


def test_evicts_least_recently_used_unheld_chunks_within_the_budget() -> None:
    directory = NodeCacheDirectory(budget_bytes=300, bytes_per_token=10)  # 3 chunks of 10 tokens
    for fact in range(3):
        _fetched(directory, fact)
    directory.touch([_key(0)])
    _fetched(directory, 3)
    assert directory.take_evictions() == (_key(1),)
    assert [directory.is_resident(_chunk(f)) for f in range(4)] == [True, False, True, True]
    assert directory.bytes_used <= 300


def test_held_and_fetching_chunks_are_never_evicted_and_a_prefetch_that_cannot_fit_changes_nothing() -> None:
    directory = NodeCacheDirectory(budget_bytes=200, bytes_per_token=10)
    _fetched(directory, 0)
    assert directory.prefetch("u", [_chunk(1)], now=0.0, wait_s=1.0)  # being fetched: reserved
    directory.hold([_key(0)])
    assert not directory.prefetch("u", [_chunk(2)], now=0.0, wait_s=1.0)
    assert directory.take_evictions() == () and directory.is_resident(_chunk(0)) and directory.bytes_used == 200
    directory.release([_key(0)])
    assert directory.prefetch("u", [_chunk(2)], now=0.0, wait_s=1.0)
    assert directory.take_evictions() == (_key(0),)


def test_a_failed_synchronous_load_stops_trusting_its_chunks() -> None:
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10)
    _fetched(directory, 0)
    directory.drop([_key(0)])
    assert not directory.is_resident(_chunk(0)) and directory.take_evictions() == (_key(0),)


def test_a_key_is_known_with_one_token_id_tuple_at_a_time() -> None:
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10)
    assert directory.prefetch("u", [_chunk(0)], now=0.0, wait_s=1.0)
    assert directory.knows_other_tokens(_chunk(0, tokens=9)) and not directory.knows_other_tokens(_chunk(0))
    directory.settle(_report(0))
    assert directory.knows_other_tokens(_chunk(0, tokens=9)) and not directory.knows_other_tokens(_chunk(1))


def test_a_fetch_expires_at_its_deadline() -> None:
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10)
    assert directory.prefetch("u", [_chunk(0)], now=0.0, wait_s=5.0)
    assert not directory.fetch_expired(_key(0), 5.0) and directory.fetch_expired(_key(0), 5.1)


def _kv(tokens: int) -> CachedKv:
    return CachedKv(torch.zeros(2, tokens, 1, 4), torch.zeros(2, tokens, 1, 4), tuple(range(tokens)))


def test_the_worker_cache_checks_token_ids_on_every_hit() -> None:
    cache = NodeKvCache()
    cache.put(_key(0), _kv(3))
    assert cache.get(_key(0), (0, 1, 2)) is not None
    assert cache.get(_key(0), (0, 1, 9)) is None
    cache.remove([_key(0)])
    assert cache.get(_key(0), (0, 1, 2)) is None and cache.bytes_used == 0


def test_cached_kv_must_hold_one_row_per_token_id() -> None:
    with pytest.raises(ValueError):
        CachedKv(torch.zeros(2, 3, 1, 4), torch.zeros(2, 3, 1, 4), (1, 2))


def test_a_slice_past_its_chunk_is_refused_before_any_kernel_reads_it() -> None:
    """Regression: the fused kernel did not bound its reads; a stale, shorter entry was read out of bounds."""
    entry = _kv(3)
    ChunkSlice(entry.keys, entry.values, 0, 3)
    for begin, end in ((0, 4), (2, 2), (-1, 2)):
        with pytest.raises(ValueError):
            ChunkSlice(entry.keys, entry.values, begin, end)


def test_a_fetched_chunk_stays_on_the_host_tier_after_its_device_eviction() -> None:
    """Device tier -> host tier: a device eviction leaves the chunk one host-to-device copy away (the directory
    then counts its bytes as the host tier's, not the memory service's)."""
    directory = NodeCacheDirectory(budget_bytes=100, bytes_per_token=10, host_budget_bytes=1000)
    assert directory.prefetch("u", [_chunk(0)], now=0.0, wait_s=1.0)
    (spec,) = directory.take_prefetches()
    assert spec.keep_on_host == {_key(0)} and spec.to_device
    directory.settle(_report(0))
    assert directory.is_resident(_chunk(0)) and directory.is_on_host(_chunk(0))
    _fetched(directory, 1)  # the device tier holds one chunk: 0 leaves it, not the host tier
    assert directory.take_evictions() == (_key(0),) and directory.take_host_evictions() == ()
    assert directory.bytes_to_bring([_chunk(0), _chunk(1), _chunk(2)]) == (100, 100)  # 0 from host, 2 from service
    assert directory.prefetch("u", [_chunk(0)], now=0.0, wait_s=1.0)
    assert directory.take_prefetches()[-1].keep_on_host == frozenset()  # already there: copied, not fetched


def test_the_host_tier_evicts_its_least_recently_used_and_a_failed_fetch_leaves_both_tiers() -> None:
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10, host_budget_bytes=200)
    _fetched(directory, 0)
    _fetched(directory, 1)
    directory.touch([_key(0)])
    _fetched(directory, 2)
    assert directory.take_host_evictions() == (_key(1),) and directory.host_bytes_used == 200
    assert directory.prefetch("u", [_chunk(3)], now=0.0, wait_s=1.0)
    assert directory.take_host_evictions() == (_key(0),)  # the least recently used again, for 3
    directory.settle(_report(3, failed=True))
    assert not directory.is_on_host(_chunk(3)) and not directory.is_resident(_chunk(3))
    assert directory.take_host_evictions() == (_key(3),) and _key(3) in directory.take_evictions()
    directory.drop([_key(2)])  # a failed load: no longer trusted in either tier
    assert not directory.is_on_host(_chunk(2)) and directory.take_host_evictions() == (_key(2),)


@pytest.mark.parametrize(("pinned", "on_host"), [(False, 3), (True, 2)])
def test_a_pinned_host_tier_counts_what_the_pinned_allocator_takes(pinned, on_host) -> None:
    """PyTorch's caching host allocator rounds each pinned tensor (an entry's keys, its values) up to a power of two:
    a 100-byte entry pins 2 x 64 bytes, so a 320-byte pinned host tier holds two such entries, not three."""
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10, host_budget_bytes=320, host_pinned=pinned)
    for fact in range(3):
        _fetched(directory, fact)
    assert sum(directory.is_on_host(_chunk(fact)) for fact in range(3)) == on_host
    assert directory.host_bytes_used == (256 if pinned else 300)
    assert directory.host_bytes(100) == (128 if pinned else 100) and directory.host_bytes(128) == 128
    assert directory.host_budget_bytes == 320 and directory.bytes_to_bring([_chunk(5)]) == (0, 100)
    directory.drop([_key(fact) for fact in range(3)])
    assert directory.host_bytes_used == 0
    assert directory.warm("u", [_chunk(fact) for fact in range(5, 8)], now=0.0, wait_s=1.0) == on_host
    assert directory.host_bytes_used == (256 if pinned else 300)
    directory.settle(PrefetchReport(warm_failed=Counter({_key(fact): 1 for fact in range(5, 8)})))
    assert directory.host_bytes_used == 0


def test_a_warm_up_fills_the_host_tier_only_and_never_the_device_tier() -> None:
    directory = NodeCacheDirectory(budget_bytes=100, bytes_per_token=10, host_budget_bytes=300)
    _fetched(directory, 0)
    directory.take_prefetches()
    assert directory.warm("u", [_chunk(0), _chunk(1), _chunk(2), _chunk(3)], now=0.0, wait_s=1.0) == 2
    (spec,) = directory.take_prefetches()  # 0 is on the host already; free room for two more, and it evicts nothing
    assert not spec.to_device and spec.keep_on_host == {_key(1), _key(2)}
    assert directory.take_evictions() == () and directory.take_host_evictions() == ()
    directory.settle(PrefetchReport(warmed=Counter({_key(1): 1})))
    assert directory.is_on_host(_chunk(1)) and not directory.is_resident(_chunk(1))
    assert directory.warm("u", [_chunk(1)], now=0.0, wait_s=1.0) == 0  # nothing twice


def test_a_host_tier_chunk_a_device_fetch_copies_from_is_not_evicted_under_it() -> None:
    """Review of issue 41: another prefetch's host reservation evicted, in the same step, the host-tier chunk a
    device fetch had just been ordered to copy from (workers apply evictions first: it came from the service)."""
    directory = NodeCacheDirectory(budget_bytes=200, bytes_per_token=10, host_budget_bytes=300)
    for fact in range(3):
        _fetched(directory, fact)  # on the host: 0, 1, 2; on the device: 1, 2
    directory.take_host_evictions()
    assert directory.is_on_host(_chunk(0)) and not directory.is_resident(_chunk(0))
    assert directory.prefetch("u", [_chunk(0)], now=0.0, wait_s=1.0)  # copied from the host tier
    assert directory.prefetch("u", [_chunk(3)], now=0.0, wait_s=1.0)  # needs host room: not 0's
    assert _key(0) not in directory.take_host_evictions()


def test_a_failed_fetch_is_remembered_for_a_while() -> None:
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10)
    assert directory.prefetch("u", [_chunk(0)], now=100.0, wait_s=1.0)
    directory.settle(_report(0, failed=True))
    assert directory.recently_failed(_key(0), 120.0, 30.0) and not directory.recently_failed(_key(0), 131.0, 30.0)
    _fetched(directory, 0)
    assert not directory.recently_failed(_key(0), 120.0, 30.0)


def test_warmed_chunks_are_the_first_to_go_and_make_room_only_for_other_warm_ups() -> None:
    """Review of issue 41: a warmed chunk entered as the most recently used, so that real prefetches evicted a
    used chunk before it; and once the host tier was full no warm-up could ever be ordered again."""
    directory = NodeCacheDirectory(budget_bytes=1000, bytes_per_token=10, host_budget_bytes=300)
    _fetched(directory, 0)  # used by a request
    directory.take_prefetches()
    assert directory.warm("u", [_chunk(1), _chunk(2)], now=0.0, wait_s=1.0) == 2
    directory.settle(PrefetchReport(warmed=Counter({_key(1): 1, _key(2): 1})))
    _fetched(directory, 3)  # needs host room: a warmed chunk nobody used goes, not 0
    assert directory.take_host_evictions() in ((_key(1),), (_key(2),))
    assert directory.is_on_host(_chunk(0))
    directory.take_prefetches()
    assert directory.warm("u", [_chunk(4)], now=0.0, wait_s=1.0) == 1  # in place of the other warmed chunk
    assert directory.take_host_evictions() in ((_key(1),), (_key(2),))
    assert directory.warm("u", [_chunk(5)], now=0.0, wait_s=1.0) == 0  # only used chunks (and a reserved one) left


def test_a_promotion_makes_host_tier_chunks_resident_at_once_evicting_only_unheld_chunks() -> None:
    """Host tier -> device tier in the step that loads them: resident at once (each rank copies them before its
    loads), room made from the least recently used chunks nobody holds; one that cannot fit changes nothing."""
    directory = NodeCacheDirectory(budget_bytes=200, bytes_per_token=10, host_budget_bytes=1000)
    for fact in range(3):
        _fetched(directory, fact)  # on the host: 0, 1, 2; on the device: 1, 2
    directory.take_evictions()
    directory.take_prefetches()
    directory.hold([_key(1)])
    assert directory.promote([_chunk(0)])
    assert directory.is_resident(_chunk(0)) and directory.fetch_id(_key(0)) is None
    assert directory.take_evictions() == (_key(2),)  # 1 is held
    assert directory.take_promotions() == (_chunk(0),) and directory.take_promotions() == ()
    assert not directory.take_prefetches() and directory.take_host_evictions() == ()
    directory.hold([_key(0)])
    assert not directory.promote([_chunk(2)])  # 0 and 1 held: no room, nothing changes
    assert directory.take_evictions() == () and directory.take_promotions() == ()
    assert directory.is_resident(_chunk(0)) and directory.is_resident(_chunk(1)) and directory.bytes_used == 200


def test_a_chunk_promoted_then_evicted_in_one_step_is_not_copied_after_its_eviction() -> None:
    """Workers apply a step's evictions before its promotions: one promoted and then evicted in the same step must
    leave the promotions, else it would stay on the device with the directory counting it gone."""
    directory = NodeCacheDirectory(budget_bytes=100, bytes_per_token=10, host_budget_bytes=1000)
    _fetched(directory, 0)
    _fetched(directory, 1)  # the device tier holds 1; the host tier 0 and 1
    directory.take_evictions()
    assert directory.promote([_chunk(0)])  # 1 makes room
    assert directory.prefetch("u", [_chunk(2)], now=0.0, wait_s=1.0)  # 0, unheld, makes room for 2
    assert directory.take_promotions() == () and _key(0) in directory.take_evictions()
    assert not directory.is_resident(_chunk(0)) and directory.is_on_host(_chunk(0))
