"""The one exception the client raises for a failed call: the gRPC status, the service's message, the request field
the message names, and the request id the service logged the call under."""

from __future__ import annotations

import re

import grpc

REQUEST_ID_KEY = "x-request-id"
# The service starts a refusal's message with the field path it refuses ("facts[3].text: must not be empty").
_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])*(?:\.[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]]*\])*)*): ")


class InferScaleError(Exception):
    """A call the memory service (or the channel) failed: `code`, `details`, `field` ("" when the message names
    none) and `request_id` ("" when the call never reached the service)."""

    def __init__(self, code: grpc.StatusCode, details: str, request_id: str = "") -> None:
        match = _FIELD.match(details)
        self.code = code
        self.details = details
        self.field = match.group(1) if match else ""
        self.request_id = request_id
        super().__init__(f"{code.name}: {details}" + (f" (request id {request_id})" if request_id else ""))

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, request_id: str) -> InferScaleError:
        # A sync call's error is a grpc.Call, an asyncio call's an AioRpcError: both answer code() and details().
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else str(error)) or ""
        return cls(code, details, request_id)
