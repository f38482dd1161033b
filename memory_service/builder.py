"""Builds everything the memory service runs, and shuts it down: the threads of blocking calls, the embedder, the
coordination database and its table families, the per-user write protocol, the LanceDB fact store, the KV tiers
and the tiered KV store, the KV pipeline, the domain operations, and the storage maintenance loops. The gRPC layer
(memory_service.server) assembles the server around what it made and serves once it is ready."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog

from memory_service.config import ServiceConfig
from memory_service.coordination import Coordination
from memory_service.embedder import Embedder
from memory_service.fact_store import FactStore
from memory_service.kv_pipeline import KvPipeline
from memory_service.kv_store import KvStoreBudgets, TieredKvStore
from memory_service.metrics import ServiceMetrics
from memory_service.object_store import S3Settings, StoreLocation
from memory_service.operations import MemoryOperations
from memory_service.sql import open_database
from memory_service.user_writes import UserWrites

log = structlog.get_logger(__name__)

# Threads for the blocking calls of reads on a shared store, sized for PostgreSQL's I/O waits, not for the CPU count.
# On the embedded store they would queue for SQLite's one lock anyway, and more threads only contend there
# (benchmarks/RESULTS.md, "Memory service under load"), so reads keep the event loop's default executor.
READ_THREADS = 32
# Threads for the blocking calls of the RPCs that write, of the workers' KV traffic, and of the nodes' KV fetches
# (memory_service.blocking): each kind on threads of its own, never queued behind the request path's reads.
WRITE_THREADS, KV_WORK_THREADS, KV_READ_THREADS = 8, 4, 8


@dataclass(frozen=True)
class Executors:
    """Where the blocking calls of writes, of the workers' KV traffic and of KV fetches run; the request path's reads
    (search, KV index lookups) use the event loop's default."""

    writes: ThreadPoolExecutor
    kv_work: ThreadPoolExecutor
    kv_reads: ThreadPoolExecutor


@dataclass(frozen=True)
class Service:
    """What the builder made, as the gRPC layer uses it."""

    operations: MemoryOperations
    embedder: Embedder
    executors: Executors


class ServiceBuilder:
    """`build` makes every part in order and `close` closes each part it made, once, in reverse order: also after a
    build that failed or was cancelled midway. `service` is set once the build has finished (the service is ready)
    and unset when `close` begins. What the builder lends (the database to the coordination store, the coordination
    store's table families to the fact store, the KV store and the pipeline) is closed by the builder alone."""

    def __init__(self, config: ServiceConfig, metrics: ServiceMetrics, header_witnesses: int = 1) -> None:
        """`header_witnesses`: worker identities that must agree on a header (AccessControl.header_witnesses)."""
        self.config = config
        self.metrics = metrics
        self.header_witnesses = header_witnesses
        self.service: Service | None = None
        self._closers: list[tuple[str, Callable[[], object]]] = []

    def _made(self, part: str, close: Callable[[], object]) -> None:
        """Registers how to close a part just made (and logs it: a start that hangs shows the last part made)."""
        log.info("part_made", part=part)
        self._closers.append((part, close))

    def _threads(self, count: int, prefix: str) -> ThreadPoolExecutor:
        executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix=prefix)
        # After the server stopped: handlers past their grace were cancelled, so nothing waits for these.
        self._made(f"{prefix} threads", lambda: executor.shutdown(wait=False, cancel_futures=True))
        return executor

    async def build(self) -> Service:
        config = self.config
        if config.coordination_url:
            asyncio.get_running_loop().set_default_executor(self._threads(READ_THREADS, "read"))
        executors = Executors(self._threads(WRITE_THREADS, "write"), self._threads(KV_WORK_THREADS, "kv-work"),
                              self._threads(KV_READ_THREADS, "kv-read"))

        embedder = Embedder(
            config.embedding_model, config.embedding_device, config.embedding_batch_size, config.embedding_threads,
            backend=config.embedding_backend, cache_dir=config.resolved_embedding_cache_dir,
            observe_query_batch=self.metrics.query_batch_queries.observe,
        )
        self._made("embedder", embedder.close)
        await embedder.load()

        location = StoreLocation.parse(config.store_uri, config.data_dir,
                                       S3Settings(config.s3_endpoint, config.s3_region, config.s3_allow_http))
        database = await asyncio.to_thread(open_database, config.coordination_url,
                                           config.data_dir / "kv" / "index.sqlite")
        self._made("coordination database", database.close)
        coordination = await asyncio.to_thread(Coordination.open, database, config.kv_max_attempts)
        self.metrics.watch_coordination(database)

        user_writes = UserWrites(coordination.user_records, shared=coordination.shared or location.shared,
                                 search_cache_bytes=config.search_cache_mb << 20)
        self._made("user writes", user_writes.close)
        fact_store = FactStore(location, user_writes, coordination.store_meta, config.embedding_model, embedder.dim,
                               lancedb_cache_bytes=config.lancedb_cache_mb << 20)
        opening = time.perf_counter()
        await fact_store.open()
        log.info("fact_store_opened", store=location.describe(), seconds=round(time.perf_counter() - opening, 3))

        if config.kv_gpu_budget_mb:
            log.warning("deprecated_option", option="--kv-gpu-budget-mb", reason="the service keeps no KV on a GPU: "
                        "blobs leave it as bytes over gRPC; the node's cache is on the GPU (--node-cache-mb)")
        budgets = KvStoreBudgets(host_bytes=config.kv_host_budget_mb << 20,
                                 disk_bytes=int(config.kv_disk_budget_gb * (1 << 30)))
        durable = await asyncio.to_thread(location.durable_kv_tier, budgets.disk_bytes)
        kv_store = await asyncio.to_thread(TieredKvStore, coordination.kv_index, coordination.work_queue,
                                           coordination.user_records, durable, budgets, coordination.shared)
        kv_pipeline = KvPipeline(fact_store, kv_store, coordination.profile_registry, coordination.work_queue,
                                 coordination.kv_index, coordination.audits, coordination.worker_registry,
                                 config.kv_lease_max_facts, config.kv_lease_seconds, config.kv_lease_max_seconds,
                                 config.kv_audit_share, self.header_witnesses)
        self.metrics.watch_kv(kv_store, kv_pipeline)
        await kv_pipeline.reconcile()

        operations = MemoryOperations(fact_store, kv_pipeline, kv_store, embedder, self.metrics, config.limits)
        await operations.refresh_stored_gauges()

        self._maintain("store optimize", self._optimize_periodically(fact_store))
        if coordination.shared:
            self._maintain("KV host cache sweep", self._sweep_host_cache_periodically(kv_store))
        self.service = Service(operations, embedder, executors)
        return self.service

    async def close(self) -> None:
        """Closes what `build` made, in reverse order; a part that fails to close is logged and the rest still
        closed. Call after the server stopped serving; calling again does nothing."""
        self.service = None
        while self._closers:
            part, close = self._closers.pop()
            try:
                closed = close()
                if inspect.isawaitable(closed):
                    await closed
            except Exception:  # the other parts must still close
                log.exception("close_failed", part=part)

    # ------------------------------------------------------------------ maintenance

    def _maintain(self, part: str, loop: Coroutine[Any, Any, None]) -> None:
        """Runs a maintenance loop until `close`."""
        task = asyncio.get_running_loop().create_task(loop)

        async def stop() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self._made(part, stop)

    async def _optimize_periodically(self, fact_store: FactStore) -> None:
        """Folds small write fragments together and into the user index, so that reading an uncached user stays an
        index lookup as ingests accumulate: every --optimize-interval-s, or as soon as --optimize-after-writes writes
        are waiting (a burst of ingest, such as a bulk import, left uncompacted makes every uncached read scan them).
        A compaction that failed, or that another replica's write preempted, is tried again after a back-off that
        doubles up to the interval, so a lasting error or a busy shared store does not make it a loop."""
        config = self.config
        last, backoff_s = time.monotonic(), 0.0
        while True:
            await asyncio.sleep(1.0)
            if not fact_store.writes_since_optimize:
                continue
            waited = time.monotonic() - last
            if waited < backoff_s or (fact_store.writes_since_optimize < config.optimize_after_writes
                                      and waited < config.optimize_interval_s):
                continue
            last = time.monotonic()
            try:
                started = time.perf_counter()
                writes = fact_store.writes_since_optimize
                if await fact_store.optimize():
                    backoff_s = 0.0
                    log.info("store_optimized", writes=writes, seconds=round(time.perf_counter() - started, 3))
                    continue
            except Exception:  # maintenance must not take the service down
                log.exception("store_optimize_failed")
            backoff_s = min(max(2 * backoff_s, 5.0), config.optimize_interval_s)

    async def _sweep_host_cache_periodically(self, kv_store: TieredKvStore) -> None:
        """Replicas sharing a store: drops cached KV that another replica deleted (the index no longer lists it)."""
        while True:
            await asyncio.sleep(self.config.tier_sweep_interval_s)
            try:
                dropped = await asyncio.to_thread(kv_store.sweep_host_cache)
                if dropped:
                    log.info("kv_tiers_swept", dropped=dropped)
            except Exception:  # maintenance must not take the service down
                log.exception("kv_tier_sweep_failed")
