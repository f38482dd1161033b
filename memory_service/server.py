"""Runs the memory service: gRPC (API, health, reflection), metrics, storage maintenance, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from inferscale.v1 import memory_pb2, memory_pb2_grpc
from memory_service.config import ServiceConfig
from memory_service.metrics import ServiceMetrics
from memory_service.servicer import MemoryServicer

log = structlog.get_logger(__name__)

SERVICE_NAME = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"].full_name


def _server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files (client certificates required when a client CA is given)."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    client_ca = config.tls_client_ca_file.read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(config.tls_key_file.read_bytes(), config.tls_cert_file.read_bytes())],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


CONNECTION_AGE_S = 300
CONNECTION_AGE_GRACE_S = 30
# Threads for the blocking calls of reads on a shared store (memory_service.blocking; writes have their own).
READ_THREADS = 32


async def _optimize_periodically(servicer: MemoryServicer) -> None:
    """Folds small write fragments together and into the user index, so that reading an uncached user stays an
    index lookup as ingests accumulate: every --optimize-interval-s, or as soon as --optimize-after-writes writes
    are waiting (a burst of ingest, such as a bulk import, left uncompacted makes every uncached read scan them).
    A compaction that failed, or that another replica's write preempted, is tried again after a back-off that
    doubles up to the interval, so a lasting error or a busy shared store does not make it a loop."""
    config = servicer.config
    last, backoff_s = time.monotonic(), 0.0
    while True:
        await asyncio.sleep(1.0)
        store = servicer.store
        if store is None or not store.writes_since_optimize:
            continue
        waited = time.monotonic() - last
        if waited < backoff_s or (store.writes_since_optimize < config.optimize_after_writes
                                  and waited < config.optimize_interval_s):
            continue
        last = time.monotonic()
        try:
            started = time.perf_counter()
            writes = store.writes_since_optimize
            if await store.optimize():
                backoff_s = 0.0
                log.info("store_optimized", writes=writes, seconds=round(time.perf_counter() - started, 3))
                continue
        except Exception:  # noqa: BLE001 - maintenance must not take the service down
            log.exception("store_optimize_failed")
        backoff_s = min(max(2 * backoff_s, 5.0), config.optimize_interval_s)


async def _sweep_tiers_periodically(servicer: MemoryServicer) -> None:
    """Replicas sharing a store: drops memory-tier KV that another replica deleted (the index no longer lists it)."""
    while True:
        await asyncio.sleep(servicer.config.tier_sweep_interval_s)
        try:
            dropped = await asyncio.to_thread(servicer.kv.kv.sweep_memory_tiers)
            if dropped:
                log.info("kv_tiers_swept", dropped=dropped)
        except Exception:  # noqa: BLE001 - maintenance must not take the service down
            log.exception("kv_tier_sweep_failed")


async def serve(config: ServiceConfig, stop: asyncio.Event | None = None) -> None:
    """Serves until `stop` is set or SIGTERM/SIGINT arrives. Health reports SERVING only once loaded."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if config.coordination_url:
        # Reads' blocking calls (memory_service.blocking) wait on PostgreSQL: threads for I/O waits, not sized by the
        # CPU count. On the embedded store they queue for SQLite's one lock anyway, and more threads only contend
        # (the full load test's saturation: 618 req/s with 32, 746-814 with Python's default).
        loop.set_default_executor(ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="read"))
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    metrics = ServiceMetrics()
    servicer = MemoryServicer(config, metrics)
    health = health_aio.HealthServicer()
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Connections are closed (gracefully) after a few minutes, so clients resolve the replicas' address again
        # and spread over replicas added since: gRPC's DNS resolver looks again only when a connection closes.
        ("grpc.max_connection_age_ms", CONNECTION_AGE_S * 1000),
        ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_S * 1000),
    ]
    server = grpc.aio.server(options=options)
    memory_pb2_grpc.add_MemoryServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{config.host}:{config.port}"
    credentials = _server_credentials(config)
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    health_server = None
    if config.health_port:
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        if health_server.add_insecure_port(f"{config.host}:{config.health_port}") == 0:
            raise OSError(f"cannot listen on {config.host}:{config.health_port}")
        await health_server.start()
    await server.start()
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.host)
    log.info("listening", port=port, metrics_port=config.metrics_port, health_port=config.health_port,
             tls="mutual" if config.tls_client_ca_file else bool(credentials), access_control=servicer.access.enabled)

    maintenance: list[asyncio.Task] = []
    try:
        load = asyncio.create_task(servicer.load())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({load, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            load.result()
            # What is alive now (libraries, models: ~400k objects) lives as long as the process. Frozen, it leaves
            # the garbage collector's view; otherwise every full collection traverses it all, stopping the event
            # loop 250-350 ms every few seconds under load.
            gc.collect()
            gc.freeze()
            for name in ("", SERVICE_NAME):
                await health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("ready", embedding_model=config.embedding_model, embedding_dim=servicer.embedder.dim)
            maintenance.append(asyncio.create_task(_optimize_periodically(servicer)))
            if servicer.kv.kv.index.shared:
                maintenance.append(asyncio.create_task(_sweep_tiers_periodically(servicer)))
            await stopped
        else:
            load.cancel()
    finally:
        log.info("stopping", grace_s=config.shutdown_grace_s)
        await health.enter_graceful_shutdown()
        for task in maintenance:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(config.shutdown_grace_s)
        if health_server is not None:
            await health_server.stop(0)
        await servicer.close()
        log.info("stopped")
