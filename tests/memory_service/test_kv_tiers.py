"""KV tiers and the tiered store: budgets, eviction, admission, pinning, fetches through the host cache, corruption,
restart."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from inferscale_kv.blob import KvBlobHeader, encode_kv_blob
from inferscale_kv.eviction import LruEviction
from inferscale_kv.kv_key import KvKey, content_id, header_key
from memory_service.coordination import Coordination
from memory_service.kv_store import KvStoreBudgets, TieredKvStore
from memory_service.kv_tiers import AdmitAll, AdmitBelowFraction, DiskTier, MemoryTier
from memory_service.sql import SqliteDatabase


def _key(index: int, user: str = "u1", version: int = 1) -> KvKey:
    return KvKey("kvp-test", user, f"fact-{index}", version, content_id("kvp-test", [7], range(4)))


def _blob(key: KvKey, tokens: int = 4) -> bytes:
    header = KvBlobHeader(profile_id=key.profile_id, user_id=key.user_id, fact_id=key.fact_id, version=key.version,
                          storage_dtype="float32", num_layers=2, num_tokens=tokens, num_kv_heads=1, head_dim=8,
                          token_ids=tuple(range(tokens)), content_id=key.content_id)
    keys = torch.full((2, tokens, 1, 8), float(hash(key) % 97))
    return encode_kv_blob(header, keys, keys + 1)


BLOB_SIZE = len(_blob(_key(0)))


def _tiered(root, budgets: KvStoreBudgets) -> tuple[TieredKvStore, Coordination]:
    """The embedded layout: the index in <root>/index.sqlite, blobs under <root>/blobs."""
    coordination = Coordination.open(SqliteDatabase(root / "index.sqlite"))
    durable = DiskTier(root / "blobs", budgets.disk_bytes, LruEviction(), AdmitAll())
    store = TieredKvStore(coordination.kv_index, coordination.work_queue, coordination.user_records, durable, budgets,
                          shared=False)
    return store, coordination


def test_memory_tier_evicts_least_recently_used_and_stays_within_budget() -> None:
    tier = MemoryTier("host", 3 * BLOB_SIZE, LruEviction(), AdmitAll())
    for index in range(3):
        assert tier.put(_key(index), _blob(_key(index)))
    tier.get(_key(0))  # 0 becomes most recent; 1 is now the LRU entry
    assert tier.put(_key(3), _blob(_key(3)))
    assert not tier.contains(_key(1))
    assert all(tier.contains(_key(i)) for i in (0, 2, 3))
    assert tier.stats.bytes <= tier.budget_bytes
    assert (tier.stats.entries, tier.stats.evictions) == (3, 1)


def test_pinned_entries_are_never_evicted() -> None:
    tier = MemoryTier("host", 2 * BLOB_SIZE, LruEviction(), AdmitAll())
    tier.put(_key(0), _blob(_key(0)))
    tier.put(_key(1), _blob(_key(1)))
    assert tier.pin(_key(0))
    tier.put(_key(2), _blob(_key(2)))
    assert tier.contains(_key(0)) and not tier.contains(_key(1))
    tier.pin(_key(2))
    assert not tier.put(_key(3), _blob(_key(3)))  # everything pinned: the put is refused, nothing evicted
    assert tier.contains(_key(0)) and tier.contains(_key(2))


def test_admission_refuses_blobs_above_the_fraction_of_the_budget() -> None:
    tier = MemoryTier("host", 10 * BLOB_SIZE, LruEviction(), AdmitBelowFraction(0.05))
    assert not tier.put(_key(0), _blob(_key(0)))
    assert tier.stats.entries == 0


def test_hits_and_lookups_are_counted_separately() -> None:
    tier = MemoryTier("host", 4 * BLOB_SIZE, LruEviction(), AdmitAll())
    tier.put(_key(0), _blob(_key(0)))
    assert tier.get(_key(0)) == _blob(_key(0))
    assert tier.get(_key(1)) is None
    assert (tier.stats.hits, tier.stats.lookups) == (1, 2)


def test_disk_tier_detects_a_corrupted_file_and_reports_it(tmp_path) -> None:
    tier = DiskTier(tmp_path, 10 * BLOB_SIZE, LruEviction(), AdmitAll())
    reported: list[KvKey] = []
    tier.on_corrupt = reported.append
    tier.put(_key(0), _blob(_key(0)))
    path = tier.path(_key(0))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert tier.get(_key(0)) is None
    assert reported == [_key(0)]
    assert not path.exists() and not tier.contains(_key(0))


def test_disk_tier_detects_a_torn_write(tmp_path) -> None:
    tier = DiskTier(tmp_path, 10 * BLOB_SIZE, LruEviction(), AdmitAll())
    tier.put(_key(0), _blob(_key(0)))
    path = tier.path(_key(0))
    path.write_bytes(path.read_bytes()[: BLOB_SIZE // 2])
    assert tier.get(_key(0)) is None


def test_disk_tier_restores_its_entries_after_restart(tmp_path) -> None:
    tier = DiskTier(tmp_path, 10 * BLOB_SIZE, LruEviction(), AdmitAll())
    keys = [_key(0), KvKey("kvp-test", "user/with:odd.chars", "f/1", 3, "0123456789abcdef" * 2)]
    for key in keys:
        tier.put(key, _blob(key))
    reopened = DiskTier(tmp_path, 10 * BLOB_SIZE, LruEviction(), AdmitAll())
    assert sorted(reopened.keys()) == sorted(keys)
    assert reopened.stats.bytes == tier.stats.bytes
    assert reopened.get(keys[1]) == _blob(keys[1])


def test_an_upload_goes_to_the_durable_tier_only_and_a_fetch_fills_the_host_cache(tmp_path) -> None:
    store, _ = _tiered(tmp_path, KvStoreBudgets(host_bytes=20 * BLOB_SIZE, disk_bytes=100 * BLOB_SIZE))
    host, disk = store.tiers
    for index in range(21):
        store.put(_key(index), _blob(_key(index)), token_ids=[1, 2, 3, 4], lease_id=None)
    assert host.stats.entries == 0 and disk.contains(_key(0))  # KV moves toward a node only when one fetches it
    assert store.get(_key(0)) == _blob(_key(0))
    assert host.contains(_key(0)) and host.stats.bytes <= host.budget_bytes


def test_a_fetch_reads_the_durable_tier_once_per_miss(tmp_path) -> None:
    # Ten blobs fit the host cache (and one blob is within its admission fraction; fact ids of two digits are longer).
    store, _ = _tiered(tmp_path, KvStoreBudgets(host_bytes=10 * BLOB_SIZE + 50, disk_bytes=100 * BLOB_SIZE))
    host, disk = store.tiers
    for index in range(11):
        store.put(_key(index), _blob(_key(index)), token_ids=[1, 2, 3, 4], lease_id=None)
    for _ in range(3):
        assert store.get(_key(0)) == _blob(_key(0))
    assert (disk.stats.hits, host.stats.hits) == (1, 2)
    assert store.bytes_read == {"host": 2 * BLOB_SIZE, "disk": BLOB_SIZE}
    for index in range(1, 11):  # the host cache holds ten blobs: key 0 leaves it
        store.get(_key(index))
    assert store.get(_key(0)) == _blob(_key(0)) and disk.stats.hits == 12  # a new miss, one more read


def test_the_host_cache_hands_out_the_stored_bytes_without_a_copy() -> None:
    tier = MemoryTier("host", 3 * BLOB_SIZE, LruEviction(), AdmitAll())
    blob = _blob(_key(0))
    tier.put(_key(0), blob)
    assert tier.get(_key(0)) is blob


def test_concurrent_misses_of_one_key_share_one_durable_read(tmp_path) -> None:
    store, _ = _tiered(tmp_path, KvStoreBudgets(host_bytes=0, disk_bytes=100 * BLOB_SIZE))
    store.put(_key(0), _blob(_key(0)), token_ids=[1, 2, 3, 4], lease_id=None)
    release = threading.Event()
    reads = []
    read = store.durable.get

    def slow_read(key: KvKey) -> bytes | None:
        reads.append(key)
        release.wait(5)
        return read(key)

    store.durable.get = slow_read  # type: ignore[method-assign]
    with ThreadPoolExecutor(4) as pool:
        results = [pool.submit(store.read, _key(0)) for _ in range(4)]
        time.sleep(0.2)  # every caller is waiting on the one read in flight
        release.set()
        assert all(result.result(5) == _blob(_key(0)) for result in results)
    assert reads == [_key(0)]


def test_a_read_that_began_before_a_forget_leaves_nothing_in_the_host_cache(tmp_path) -> None:
    store, _ = _tiered(tmp_path, KvStoreBudgets(host_bytes=10 * BLOB_SIZE, disk_bytes=100 * BLOB_SIZE))
    store.put(_key(0), _blob(_key(0)), token_ids=[1, 2, 3, 4], lease_id=None)
    blob = _blob(_key(0))

    def read_then_forgotten(key: KvKey) -> bytes | None:
        store.forget("u1", ["fact-0"])  # the fact is deleted while its blob is being read
        return blob

    store.durable.get = read_then_forgotten  # type: ignore[method-assign]
    assert store.read(_key(0)) == blob  # the read in flight completes
    assert store.host_cache is not None and not store.host_cache.contains(_key(0))
    assert store.get(_key(0)) is None


def test_store_requeues_a_corrupt_blob_for_recomputation(tmp_path) -> None:
    store, coordination = _tiered(tmp_path, KvStoreBudgets(host_bytes=0, disk_bytes=100 * BLOB_SIZE))
    coordination.profile_registry.add("kvp-test", {})
    coordination.work_queue.enqueue(["kvp-test"], [("u1", "fact-0", 1)])
    store.put(_key(0), _blob(_key(0)), token_ids=[1, 2, 3, 4], lease_id=None)
    assert coordination.kv_index.stored("kvp-test").done == 1
    store.durable.path(_key(0)).write_bytes(b"garbage")
    assert store.get(_key(0)) is None
    assert (coordination.kv_index.stored("kvp-test").done, coordination.work_queue.counts("kvp-test").queued) == (0, 1)
    assert store.corrupt_blobs == 1


def test_disk_eviction_forgets_the_index_entry_and_every_tiers_copy(tmp_path) -> None:
    store, coordination = _tiered(tmp_path, KvStoreBudgets(host_bytes=100 * BLOB_SIZE, disk_bytes=2 * BLOB_SIZE))
    for index in range(3):
        store.put(_key(index), _blob(_key(index)), token_ids=[1, 2, 3, 4], lease_id=None)
    assert coordination.kv_index.entry("kvp-test", "u1", "fact-0") is None
    assert not any(tier.contains(_key(0)) for tier in store.tiers)  # no unservable copy left in memory
    assert coordination.kv_index.entry("kvp-test", "u1", "fact-2").key == _key(2)


def test_header_kv_is_pinned_in_every_tier_also_after_restart(tmp_path) -> None:
    """Regression: the header was evicted from the disk tier first (it is never read there)."""
    budgets = KvStoreBudgets(host_bytes=10 * BLOB_SIZE, disk_bytes=3 * BLOB_SIZE)  # the host admits one blob per put
    store, coordination = _tiered(tmp_path, budgets)
    header = header_key("kvp-test", range(4))
    store.put(header, _blob(header), token_ids=list(range(4)), lease_id=None)
    assert store.get(header) == _blob(header)  # fetched once: in the host cache from now on
    for index in range(14):
        store.put(_key(index), _blob(_key(index)), token_ids=[1, 2, 3, 4], lease_id=None)
        store.get(_key(index))
    assert all(tier.contains(header) for tier in store.tiers)
    assert coordination.kv_index.header_entry("kvp-test").key == header
    coordination.database.close()
    reopened, _ = _tiered(tmp_path, budgets)
    for index in range(6, 9):
        reopened.put(_key(index), _blob(_key(index)), token_ids=[1, 2, 3, 4], lease_id=None)
    assert reopened.durable.contains(header) and reopened.get(header) == _blob(header)


def test_a_lost_header_is_not_queued_as_a_fact(tmp_path) -> None:
    store, coordination = _tiered(tmp_path, KvStoreBudgets(host_bytes=0, disk_bytes=10 * BLOB_SIZE))
    header = header_key("kvp-test", range(4))
    store.put(header, _blob(header), token_ids=list(range(4)), lease_id=None)
    store.durable.path(header).write_bytes(b"garbage")
    assert store.get(header) is None
    # LeaseKvWork now asks workers for it (header_kv_wanted)
    assert coordination.kv_index.header_entry("kvp-test") is None
    assert coordination.work_queue.all_jobs() == []


def test_get_serves_only_what_the_index_lists_under_exactly_that_key(tmp_path) -> None:
    store, _ = _tiered(tmp_path, KvStoreBudgets(host_bytes=10 * BLOB_SIZE, disk_bytes=10 * BLOB_SIZE))
    store.put(_key(0), _blob(_key(0)), token_ids=[1, 2, 3, 4], lease_id=None)
    other_content = KvKey("kvp-test", "u1", "fact-0", 1, "f" * 32)
    assert store.get(other_content) is None
    store.forget("u1", ["fact-0"])
    assert store.get(_key(0)) is None and not any(tier.contains(_key(0)) for tier in store.tiers)


def test_a_completion_counts_only_under_the_lease_that_holds_the_job(tmp_path) -> None:
    store, coordination = _tiered(tmp_path, KvStoreBudgets(host_bytes=10 * BLOB_SIZE, disk_bytes=10 * BLOB_SIZE))
    coordination.profile_registry.add("kvp-test", {})
    coordination.work_queue.enqueue(["kvp-test"], [("u1", "fact-0", 1)])
    lease_id, _, jobs = coordination.work_queue.lease("kvp-test", 10, 60)
    assert len(jobs) == 1
    assert not store.put(_key(0), _blob(_key(0)), [1, 2, 3, 4], lease_id="another-lease")
    assert not store.durable.contains(_key(0)) and coordination.kv_index.entry("kvp-test", "u1", "fact-0") is None
    store.forget("u1", ["fact-0"])  # deleted while leased: the lease no longer holds a job
    assert not store.put(_key(0), _blob(_key(0)), [1, 2, 3, 4], lease_id=lease_id)
    assert list(store.durable.keys()) == [] and coordination.kv_index.all_entry_keys() == []


def test_a_late_completion_of_a_stored_key_leaves_its_blob_servable(tmp_path) -> None:
    """Regression: a lease that expired and was completed by another worker, completing late with the same key
    (the same context, so the same content id), removed the stored file while the index kept listing it."""
    store, coordination = _tiered(tmp_path, KvStoreBudgets(host_bytes=0, disk_bytes=10 * BLOB_SIZE))
    coordination.profile_registry.add("kvp-test", {})
    coordination.work_queue.enqueue(["kvp-test"], [("u1", "fact-0", 1)])
    late_lease, _, _ = coordination.work_queue.lease("kvp-test", 10, 0.0)  # expires at once: the job is leased again
    lease_id, _, jobs = coordination.work_queue.lease("kvp-test", 10, 60)
    assert len(jobs) == 1
    blob = _blob(_key(0))
    assert store.put(_key(0), blob, [1, 2, 3, 4], lease_id=lease_id)
    assert not store.put(_key(0), blob, [1, 2, 3, 4], lease_id=late_lease)
    assert not store.put(_key(0), blob, [1, 2, 3, 4], lease_id=lease_id)  # a retried completion
    assert store.get(_key(0)) == blob and store.durable.contains(_key(0))


def test_disk_tier_drops_files_of_an_older_layout_at_start(tmp_path) -> None:
    old = tmp_path / "kvp-test" / "u1" / "fact-0.v1.kv"
    old.parent.mkdir(parents=True)
    old.write_bytes(_blob(_key(0)))
    tier = DiskTier(tmp_path, 10 * BLOB_SIZE, LruEviction(), AdmitAll())
    assert list(tier.keys()) == [] and not old.exists()


def test_disk_tier_refuses_a_file_whose_blob_names_another_key(tmp_path) -> None:
    tier = DiskTier(tmp_path, 10 * BLOB_SIZE, LruEviction(), AdmitAll())
    tier.put(_key(0), _blob(_key(1)))
    assert tier.get(_key(0)) is None


def test_a_read_that_starts_while_a_forget_runs_leaves_nothing_in_the_host_cache(tmp_path) -> None:
    """Regression: the forget cleared the cache before it removed the durable copy, so a read starting in between
    (its index check done earlier) read the file and cached the deleted fact's KV."""
    store, _ = _tiered(tmp_path, KvStoreBudgets(host_bytes=10 * BLOB_SIZE, disk_bytes=100 * BLOB_SIZE))
    store.put(_key(0), _blob(_key(0)), token_ids=[1, 2, 3, 4], lease_id=None)
    remove = store.durable.remove

    def remove_while_a_read_starts(key: KvKey) -> bool:
        store.read(key)  # a fetch that listed the key before the forget began
        return remove(key)

    store.durable.remove = remove_while_a_read_starts  # type: ignore[method-assign]
    store.forget("u1", ["fact-0"])
    assert store.host_cache is not None and not store.host_cache.contains(_key(0))


def test_a_forget_of_other_facts_during_a_miss_does_not_keep_the_blob_out_of_the_host_cache(tmp_path) -> None:
    store, _ = _tiered(tmp_path, KvStoreBudgets(host_bytes=10 * BLOB_SIZE, disk_bytes=100 * BLOB_SIZE))
    for index in range(2):
        store.put(_key(index), _blob(_key(index)), token_ids=[1, 2, 3, 4], lease_id=None)
    get = store.durable.get

    def read_while_another_fact_is_forgotten(key: KvKey) -> bytes | None:
        if key == _key(0):
            store.forget("u1", ["fact-1"])  # an ingest of another fact, say
        return get(key)

    store.durable.get = read_while_another_fact_is_forgotten  # type: ignore[method-assign]
    assert store.read(_key(0)) == _blob(_key(0))
    assert store.host_cache is not None and store.host_cache.contains(_key(0))


def test_the_sweep_drops_a_copy_cached_after_another_replica_deleted_it(tmp_path) -> None:
    """Regression: a read that overlapped another replica's delete cached the blob after the sweep had recorded the
    user's moved generation, and no later sweep looked at it again."""
    coordination = Coordination.open(SqliteDatabase(tmp_path / "index.sqlite"))
    durable = DiskTier(tmp_path / "blobs", 100 * BLOB_SIZE, LruEviction(), AdmitAll())
    store = TieredKvStore(coordination.kv_index, coordination.work_queue, coordination.user_records, durable,
                          KvStoreBudgets(host_bytes=10 * BLOB_SIZE), shared=True)
    for index in range(2):
        store.put(_key(index), _blob(_key(index)), token_ids=[1, 2, 3, 4], lease_id=None)
    store.read(_key(0))
    assert store.sweep_host_cache() == 0  # the user's generation is recorded
    coordination.kv_index.forget_facts("u1", ["fact-1"])  # another replica deletes fact-1
    coordination.user_records.invalidate("u1")
    assert store.sweep_host_cache() == 0  # the moved generation is recorded; fact-1 is not cached yet
    store.read(_key(1))  # a fetch on this replica that listed fact-1 before the delete: its copy is cached now
    assert store.host_cache is not None and store.host_cache.contains(_key(1))
    assert store.sweep_host_cache() == 1
    assert not store.host_cache.contains(_key(1)) and store.host_cache.contains(_key(0))


def test_a_corrupt_blob_of_a_fact_deleted_meanwhile_queues_nothing(tmp_path) -> None:
    store, coordination = _tiered(tmp_path, KvStoreBudgets(host_bytes=0, disk_bytes=100 * BLOB_SIZE))
    coordination.profile_registry.add("kvp-test", {})
    store.put(_key(0), _blob(_key(0)), token_ids=[1, 2, 3, 4], lease_id=None)
    store.forget("u1", ["fact-0"])
    store.durable.on_corrupt(_key(0))  # a read that found it corrupt, reported after the delete
    assert coordination.work_queue.all_jobs() == [] and store.corrupt_blobs == 0
