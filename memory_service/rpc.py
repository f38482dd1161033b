"""What every RPC of the servicer goes through: the request id and the log context, access control, readiness, the
threads its blocking calls run on, metrics and the `rpc` log line, and the one place where domain errors become gRPC
status codes."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

import grpc
import structlog

from memory_service.access import CALLER, AccessControl
from memory_service.blocking import blocking_calls_on
from memory_service.errors import MemoryServiceError, NotReady, status_code_for
from memory_service.metrics import ServiceMetrics
from memory_service.steps import start_step_clock

log = structlog.get_logger(__name__)

REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_CHARS = 128


class RpcServicer(Protocol):
    """What the wrapper needs of the servicer whose methods it wraps."""

    access: AccessControl
    metrics: ServiceMetrics

    @property
    def ready(self) -> bool:
        """Whether the service is built: calls before are UNAVAILABLE."""

    def executor_for(self, method: str) -> Executor | None:
        """Where the method's blocking calls run (memory_service.blocking); None: the event loop's default."""


Servicer = TypeVar("Servicer", bound=RpcServicer)
Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]]


def _usable_request_id(candidate: str | None) -> bool:
    """A client's request id is echoed in trailing metadata, so it must be a valid metadata value."""
    return bool(candidate) and len(candidate or "") <= MAX_REQUEST_ID_CHARS and all(
        " " <= char <= "~" for char in candidate or "")


def rpc(handler: Handler) -> Handler:
    """Wraps a servicer method: request id and logging context, access control, readiness, executor, metrics, error
    mapping. A handler raises domain errors (memory_service.errors); anything else is logged and answered INTERNAL."""
    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(self: RpcServicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        metadata = dict(context.invocation_metadata() or ())
        request_id = next((candidate for candidate in (metadata.get(REQUEST_ID_KEY), getattr(request, "request_id", ""))
                           if _usable_request_id(candidate)), None) or uuid.uuid4().hex
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id),))
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(
            request_id=request_id, method=method, user_id=getattr(request, "user_id", None)
        )
        started = time.perf_counter()
        steps = start_step_clock()
        code = grpc.StatusCode.OK
        error: BaseException | None = None
        try:
            principal = self.access.authenticate(metadata)
            structlog.contextvars.bind_contextvars(caller=principal.name)
            principal.authorize(method, request)
            CALLER.set(principal)
            if not self.ready:
                raise NotReady("the memory service is starting; retry shortly")
            executor = self.executor_for(method)
            if executor is not None:
                with blocking_calls_on(executor):
                    return await handler(self, request, context)
            return await handler(self, request, context)
        except asyncio.CancelledError:  # the client cancelled or its deadline passed: no status to send
            code = grpc.StatusCode.CANCELLED
            raise
        except MemoryServiceError as exc:
            code, error = status_code_for(exc), exc
        except Exception as exc:  # a bug must become INTERNAL, not a dropped stream
            code, error = grpc.StatusCode.INTERNAL, exc
            log.exception("rpc_failed")
        finally:
            if steps.ms:
                steps.step_done("rest")
            elapsed = time.perf_counter() - started
            self.metrics.rpc_requests.labels(method=method, code=code.name).inc()
            self.metrics.rpc_duration.labels(method=method).observe(elapsed)
            log.info("rpc", code=code.name, duration_ms=round(elapsed * 1000, 3), error=str(error) if error else None,
                     **({"steps_ms": steps.ms} if steps.ms else {}))
        message = str(error) if code != grpc.StatusCode.INTERNAL else f"internal error (request id {request_id})"
        await context.abort(code, message)

    return wrapper
