"""How workers and inference nodes reach the memory service: a bearer token as `authorization` call metadata, and
TLS (mutual when a client certificate is given) on the channel.

The address may name every replica at once: `dns:///memory-service.inferscale:50051` (a Kubernetes headless
Service), or `ipv4:10.0.0.1:50051,10.0.0.2:50051`. Calls are spread over the replicas (round robin), and a call that
fails UNAVAILABLE (its replica went away) is retried on another if repeating it is harmless: reads, ingest (facts and
turns are upserted by id), profile announcements and KV completions (a repeat counts as a duplicate). Deletes and
leases are not retried (a repeated delete answers NOT_FOUND, a repeated lease strands the first one), nor is a call
whose request is larger than gRPC's retry buffer (256 KiB: large ingest or completion batches).

Both come from the environment only (never flags: flags reach logs and vLLM's printed config), named by the
caller's role prefix (WORKER or NODE below):
  <ROLE>MEMORY_SERVICE_TOKEN          the bearer token
  <ROLE>MEMORY_SERVICE_TLS_CA_FILE    PEM CA that signed the service's certificate (set: the channel uses TLS)
  <ROLE>MEMORY_SERVICE_TLS_CERT_FILE  PEM client certificate and
  <ROLE>MEMORY_SERVICE_TLS_KEY_FILE   its key, for a service that requires client certificates
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Sequence
from pathlib import Path

import grpc

from inferscale_kv.limits import MAX_MESSAGE_BYTES

AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "Bearer "
WORKER = "INFERSCALE_WORKER_"
NODE = "INFERSCALE_NODE_"
WORKER_TOKEN_ENV = f"{WORKER}MEMORY_SERVICE_TOKEN"
NODE_TOKEN_ENV = f"{NODE}MEMORY_SERVICE_TOKEN"
_SERVICE_CONFIG = json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{"name": [{"service": "inferscale.v1.MemoryService", "method": method} for method in (
        "IngestFacts", "IngestTurns", "SearchFacts", "ListFacts", "RetrieveAndStage", "RetrieveAndStageBatch",
        "FetchKv", "GetStats",
        "AnnounceProfile", "CompleteKvWork")],
                      "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                                      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}],
})
REPLICA_OPTIONS: tuple[tuple[str, str | int], ...] = (("grpc.service_config", _SERVICE_CONFIG),
                                                      ("grpc.enable_retries", 1))


def bearer_metadata(role: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the role's token; empty when it is unset (a service without access control)."""
    token = os.environ.get(f"{role}MEMORY_SERVICE_TOKEN", "")
    return ((AUTHORIZATION_KEY, BEARER_PREFIX + token),) if token else ()


def channel_credentials(role: str) -> grpc.ChannelCredentials | None:
    """TLS credentials from the role's environment; None (plaintext) when no CA file is named."""
    def read(setting: str) -> bytes | None:
        path = os.environ.get(f"{role}MEMORY_SERVICE_TLS_{setting}_FILE")
        return Path(path).read_bytes() if path else None

    ca = read("CA")
    if ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=read("KEY"), certificate_chain=read("CERT"))


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _with_token(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)


def memory_service_channel(address: str, role: str,
                           options: Sequence[tuple[str, str | int]] | None = None) -> grpc.Channel:
    """A (synchronous) channel to the memory service's replicas with the role's TLS settings, whose every call
    carries the role's token, if set."""
    credentials = channel_credentials(role)
    channel_options = [*REPLICA_OPTIONS, *(options or [])]
    channel = (grpc.secure_channel(address, credentials, options=channel_options) if credentials
               else grpc.insecure_channel(address, options=channel_options))
    metadata = bearer_metadata(role)
    return grpc.intercept_channel(channel, _BearerToken(metadata)) if metadata else channel


def memory_service_aio_channel(address: str, role: str) -> grpc.aio.Channel:
    """The asyncio channel of the same settings, taking answers as large as the memory service sends at its
    defaults (a batch of calls' facts); its callers pass `bearer_metadata(role)` per call."""
    credentials = channel_credentials(role)
    options = (*REPLICA_OPTIONS, ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES))
    return (grpc.aio.secure_channel(address, credentials, options=options) if credentials
            else grpc.aio.insecure_channel(address, options=options))
