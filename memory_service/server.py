"""Runs the memory service: the gRPC server (API, health, reflection, ports, TLS) and the metrics endpoint around
what memory_service.builder makes; health says SERVING once it is built; shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from inferscale.v1 import memory_pb2
from memory_service.access import AccessControl
from memory_service.builder import ServiceBuilder
from memory_service.config import ServiceConfig
from memory_service.metrics import ServiceMetrics
from memory_service.rpc import add_to_server
from memory_service.servicer import MemoryServicer
from memory_service.user_tokens import UserTokens

log = structlog.get_logger(__name__)

SERVICE = memory_pb2.DESCRIPTOR.services_by_name["MemoryService"]
SERVICE_NAME = SERVICE.full_name


def _server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files (client certificates required when a client CA is given)."""
    if config.tls_cert_file is None or config.tls_key_file is None:
        return None
    client_ca = config.tls_client_ca_file.read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(config.tls_key_file.read_bytes(), config.tls_cert_file.read_bytes())],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


# Connections are closed (gracefully) after a few minutes, so clients resolve the replicas' address again and spread
# over replicas added since: gRPC's DNS resolver looks again only when a connection closes.
CONNECTION_AGE_S = 300
CONNECTION_AGE_GRACE_S = 30


async def serve(config: ServiceConfig, stop: asyncio.Event | None = None) -> None:
    """Serves until `stop` is set or SIGTERM/SIGINT arrives. Health reports SERVING only once built."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    # A bad credentials file or user-token key fails the start, before it listens.
    user_tokens = UserTokens.from_file(config.user_token_public_key_file, config.user_token_issuer,
                                       config.user_token_audience, config.user_token_max_lifetime_s) \
        if config.user_token_public_key_file else None
    access = AccessControl.from_file(config.auth_file, user_tokens)
    metrics = ServiceMetrics()
    builder = ServiceBuilder(config, metrics, access.header_witnesses)
    servicer = MemoryServicer(builder, access, metrics, config.limits)
    health = health_aio.HealthServicer()
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_connection_age_ms", CONNECTION_AGE_S * 1000),
        ("grpc.max_connection_age_grace_ms", CONNECTION_AGE_GRACE_S * 1000),
    ]
    server = grpc.aio.server(options=options)
    add_to_server(servicer, SERVICE, memory_pb2, server)
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
             tls="mutual" if config.tls_client_ca_file else bool(credentials), access_control=access.enabled,
             user_bound_nodes=user_tokens is not None)

    try:
        build = asyncio.create_task(builder.build())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({build, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if build.done():
            service = build.result()
            # What is alive now (libraries, models) lives as long as the process. Frozen, it leaves the garbage
            # collector's view; otherwise every full collection traverses it all, stopping the event loop.
            gc.collect()
            gc.freeze()
            for name in ("", SERVICE_NAME):
                await health.set(name, health_pb2.HealthCheckResponse.SERVING)
            log.info("ready", embedding_model=config.embedding_model, embedding_dim=service.embedder.dim)
            await stopped
        else:
            build.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await build  # what it made so far is closed below, once it stopped making more
    finally:
        log.info("stopping", grace_s=config.shutdown_grace_s)
        await health.enter_graceful_shutdown()
        await server.stop(config.shutdown_grace_s)
        if health_server is not None:
            await health_server.stop(0)
        await builder.close()
        log.info("stopped")
