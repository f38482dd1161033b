"""What every RPC of the servicer goes through: the request id and the log context, access control, readiness, the
threads its blocking calls run on, metrics and the `rpc` log line, and the one place where domain errors become gRPC
status codes (a request whose bytes did not parse among them: `add_to_server` registers deserializers that hand the
handler an UnparsableRequest instead of raising, which gRPC would answer UNKNOWN)."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from types import ModuleType
from typing import Any, Protocol, TypeVar

import grpc
import structlog
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

from memory_service.access import CALLER, AccessControl
from memory_service.blocking import blocking_calls_on
from memory_service.errors import InvalidArgument, MemoryServiceError, NotReady, status_code_for
from memory_service.metrics import ServiceMetrics
from memory_service.steps import start_step_clock
from memory_service.wire_format import UnparsableRequest, request_parser

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
        entries = tuple(context.invocation_metadata() or ())
        metadata = dict(entries)
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
            principal = self.access.authenticate(entries)
            structlog.contextvars.bind_contextvars(caller=principal.name)
            if isinstance(request, UnparsableRequest):
                principal.authorize_method(method)
                raise InvalidArgument(request.field, f"{request.problem}: not a valid {request.message_type}")
            self.access.authorize(principal, method, request)
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


def _serialized(response: Message | bytes) -> bytes:
    """A response as it goes on the wire: a message is serialized here (on the event loop), bytes a handler serialized
    itself (off the loop) pass as they are."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_to_server(servicer: object, service: ServiceDescriptor, messages: ModuleType, server: grpc.aio.Server) -> None:
    """Registers `servicer`'s methods for every RPC of `service` (request and response classes from `messages`) with
    request deserializers that never raise (memory_service.wire_format.request_parser): a request that does not
    parse reaches the `rpc` wrapper, which answers INVALID_ARGUMENT naming where it broke. A handler may write a
    response it serialized itself, as bytes."""
    handlers = {}
    for method in service.methods:
        make_handler = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                        else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = make_handler(
            getattr(servicer, method.name),
            request_deserializer=request_parser(getattr(messages, method.input_type.name)),
            response_serializer=_serialized)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
