"""Domain errors of the memory service and the one place that maps them to gRPC status codes."""

from __future__ import annotations

import grpc


class MemoryServiceError(Exception):
    """Base of the errors a caller can cause or observe; the message is returned to the caller."""


class InvalidArgument(MemoryServiceError):
    """A request field is malformed."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class LimitExceeded(MemoryServiceError):
    """A request exceeds a configured size limit."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


class NotFound(MemoryServiceError):
    """The named entity does not exist."""


class NotReady(MemoryServiceError):
    """The service is still loading its storage or embedder."""


class Unauthenticated(MemoryServiceError):
    """The call carries no credential, or one the service does not know."""


class PermissionDenied(MemoryServiceError):
    """The caller's credential does not allow this call or these users."""


class NotLeaseHolder(PermissionDenied):
    """A worker completed KV work under a lease that was not given to it."""


_STATUS_BY_ERROR: dict[type[MemoryServiceError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    NotFound: grpc.StatusCode.NOT_FOUND,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_code_for(error: BaseException) -> grpc.StatusCode:
    """The gRPC status for an error; anything not a domain error is INTERNAL."""
    for error_type in type(error).__mro__:
        if error_type in _STATUS_BY_ERROR:
            return _STATUS_BY_ERROR[error_type]
    return grpc.StatusCode.INTERNAL
