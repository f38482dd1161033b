"""How callers present a credential to the memory service: `authorization: Bearer <token>` call metadata.

Workers and inference nodes read their token from the environment only (never a flag: flags reach logs and
vLLM's printed config): INFERSCALE_WORKER_MEMORY_SERVICE_TOKEN, INFERSCALE_NODE_MEMORY_SERVICE_TOKEN.
"""

from __future__ import annotations

import collections
import os

import grpc

AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "Bearer "
WORKER_TOKEN_ENV = "INFERSCALE_WORKER_MEMORY_SERVICE_TOKEN"
NODE_TOKEN_ENV = "INFERSCALE_NODE_MEMORY_SERVICE_TOKEN"


def bearer_metadata(token_env: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the token in `token_env`; empty when it is unset (a service without access control)."""
    token = os.environ.get(token_env, "")
    return ((AUTHORIZATION_KEY, BEARER_PREFIX + token),) if token else ()


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


def memory_service_channel(address: str, token_env: str, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
    """A (synchronous) channel to the memory service whose every call carries the token in `token_env`, if set."""
    channel = grpc.insecure_channel(address, options=options or [])
    metadata = bearer_metadata(token_env)
    return grpc.intercept_channel(channel, _BearerToken(metadata)) if metadata else channel
