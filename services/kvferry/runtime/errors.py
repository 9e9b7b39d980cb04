"""Domain errors and the one table that turns them into gRPC and HTTP statuses.

Domain code raises a :class:`ServiceError` subclass with a message the caller can act on; it never
names a protocol. Only the edges translate: gRPC handlers through :func:`unary` / :func:`streaming`
(or :func:`abort`), HTTP handlers through :func:`http_status`, and clients of other services map the
status they receive back with :func:`error_kind_of` (grpc/grpc ``examples/python/errors``; the codes
are the canonical ones of google.aip.dev/193, with Google's HTTP mapping).
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc

log = logging.getLogger(__name__)


class ErrorKind(enum.Enum):
    """What went wrong, independent of the protocol that reports it (the canonical error codes)."""

    CANCELLED = enum.auto()
    UNKNOWN = enum.auto()
    INVALID_ARGUMENT = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()
    NOT_FOUND = enum.auto()
    ALREADY_EXISTS = enum.auto()
    PERMISSION_DENIED = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    ABORTED = enum.auto()
    OUT_OF_RANGE = enum.auto()
    UNIMPLEMENTED = enum.auto()
    INTERNAL = enum.auto()
    UNAVAILABLE = enum.auto()
    DATA_LOSS = enum.auto()
    UNAUTHENTICATED = enum.auto()


@dataclass(frozen=True)
class Status:
    grpc: grpc.StatusCode
    http: int


# The one table: every kind's gRPC code and HTTP status.
STATUS: dict[ErrorKind, Status] = {
    ErrorKind.CANCELLED: Status(grpc.StatusCode.CANCELLED, 499),
    ErrorKind.UNKNOWN: Status(grpc.StatusCode.UNKNOWN, 500),
    ErrorKind.INVALID_ARGUMENT: Status(grpc.StatusCode.INVALID_ARGUMENT, 400),
    ErrorKind.DEADLINE_EXCEEDED: Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    ErrorKind.NOT_FOUND: Status(grpc.StatusCode.NOT_FOUND, 404),
    ErrorKind.ALREADY_EXISTS: Status(grpc.StatusCode.ALREADY_EXISTS, 409),
    ErrorKind.PERMISSION_DENIED: Status(grpc.StatusCode.PERMISSION_DENIED, 403),
    ErrorKind.RESOURCE_EXHAUSTED: Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    ErrorKind.FAILED_PRECONDITION: Status(grpc.StatusCode.FAILED_PRECONDITION, 400),
    ErrorKind.ABORTED: Status(grpc.StatusCode.ABORTED, 409),
    ErrorKind.OUT_OF_RANGE: Status(grpc.StatusCode.OUT_OF_RANGE, 400),
    ErrorKind.UNIMPLEMENTED: Status(grpc.StatusCode.UNIMPLEMENTED, 501),
    ErrorKind.INTERNAL: Status(grpc.StatusCode.INTERNAL, 500),
    ErrorKind.UNAVAILABLE: Status(grpc.StatusCode.UNAVAILABLE, 503),
    ErrorKind.DATA_LOSS: Status(grpc.StatusCode.DATA_LOSS, 500),
    ErrorKind.UNAUTHENTICATED: Status(grpc.StatusCode.UNAUTHENTICATED, 401),
}
_KIND_BY_GRPC = {status.grpc: kind for kind, status in STATUS.items()}


class ServiceError(Exception):
    """Base of every error a service reports to its caller as-is; the message says what to do."""

    kind: ErrorKind = ErrorKind.INTERNAL
    # An HTTP status more precise than the kind's (413 for a body too large); None: the table's.
    http_status: int | None = None

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_seconds: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        # The request field at fault, where one is (OpenAI error bodies carry it).
        self.param = param
        # When trying again may succeed (HTTP Retry-After, gRPC trailing metadata ``retry-after``).
        self.retry_after_seconds = retry_after_seconds


class InvalidArgument(ServiceError):
    """The request itself is malformed; resending it unchanged fails again."""

    kind = ErrorKind.INVALID_ARGUMENT


class NotFound(ServiceError):
    kind = ErrorKind.NOT_FOUND


class AlreadyExists(ServiceError):
    kind = ErrorKind.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    """Well-formed, but the current state refuses it."""

    kind = ErrorKind.FAILED_PRECONDITION


class Aborted(ServiceError):
    """A concurrent change won; retrying the whole operation may succeed."""

    kind = ErrorKind.ABORTED


class ResourceExhausted(ServiceError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class RequestTooLarge(InvalidArgument):
    """A request body above the service's limit: HTTP 413."""

    http_status = 413


class PermissionDenied(ServiceError):
    kind = ErrorKind.PERMISSION_DENIED


class Unauthenticated(ServiceError):
    kind = ErrorKind.UNAUTHENTICATED


class Unavailable(ServiceError):
    """A dependency is unreachable for now; retrying later may succeed."""

    kind = ErrorKind.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class Internal(ServiceError):
    """A bug or a broken dependency; the service's log says more."""

    kind = ErrorKind.INTERNAL


_CLASS_BY_KIND: dict[ErrorKind, type[ServiceError]] = {
    cls.kind: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        Aborted,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
}


def error_of_kind(kind: ErrorKind, message: str) -> ServiceError:
    """An error of ``kind`` (to pass on another service's refusal with the same status)."""
    cls = _CLASS_BY_KIND.get(kind)
    if cls is not None:
        return cls(message)
    error = ServiceError(message)
    error.kind = kind  # the rare kinds have no class of their own
    return error


def grpc_code(error: ServiceError) -> grpc.StatusCode:
    return STATUS[error.kind].grpc


def http_status(error: ServiceError) -> int:
    return error.http_status if error.http_status is not None else STATUS[error.kind].http


def error_kind_of(code: grpc.StatusCode) -> ErrorKind:
    """The kind of a gRPC status a client received (UNKNOWN for OK, which is no error)."""
    return _KIND_BY_GRPC.get(code, ErrorKind.UNKNOWN)


def internal_error(error: BaseException, service: str, where: str) -> Internal:
    """A bug's report to the caller: logged here with its traceback, named plainly there."""
    log.error("internal error", exc_info=error, extra={"service": service, "where": where})
    return Internal(
        f"internal error in the {service} ({where}: {type(error).__name__}); see the {service}'s log"
    )


async def abort(context: grpc.aio.ServicerContext, error: ServiceError, method: str) -> NoReturn:
    """Ends the RPC with ``error``'s status and message (logged: failures of the service itself as
    warnings, a caller's mistakes at debug)."""
    code = grpc_code(error)
    server_side = error.kind in (ErrorKind.UNAVAILABLE, ErrorKind.INTERNAL)
    log.log(
        logging.WARNING if server_side else logging.DEBUG,
        "request refused",
        extra={"method": method, "code": code.name, "error": error.message},
    )
    trailers = (
        (("retry-after", str(error.retry_after_seconds)),) if error.retry_after_seconds is not None else ()
    )
    await context.abort(code, error.message, trailers)
    raise AssertionError("unreachable: abort raises")


Servicer = TypeVar("Servicer")
Request = TypeVar("Request")
Response = TypeVar("Response")


def unary(
    service: str,
) -> Callable[
    [Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]]],
    Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]],
]:
    """Decorates a unary-response handler of ``service`` (e.g. ``"registry"``): a ServiceError becomes
    its status, any other exception INTERNAL with a message that points at the log."""

    def decorate(
        handler: Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]],
    ) -> Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Response]]:
        @functools.wraps(handler)
        async def wrapped(self: Servicer, request: Request, context: grpc.aio.ServicerContext) -> Response:
            try:
                return await handler(self, request, context)
            except grpc.aio.AbortError:
                raise
            except ServiceError as error:
                await abort(context, error, handler.__name__)
            except Exception as error:
                await abort(context, internal_error(error, service, handler.__name__), handler.__name__)

        return wrapped

    return decorate


def streaming(
    service: str,
) -> Callable[
    [Callable[[Servicer, Request, grpc.aio.ServicerContext], AsyncIterator[Response]]],
    Callable[[Servicer, Request, grpc.aio.ServicerContext], AsyncIterator[Response]],
]:
    """Decorates a response-streaming handler of ``service`` the way :func:`unary` does; the handler's
    generator is closed however the call ends."""

    def decorate(
        handler: Callable[[Servicer, Request, grpc.aio.ServicerContext], AsyncIterator[Response]],
    ) -> Callable[[Servicer, Request, grpc.aio.ServicerContext], AsyncIterator[Response]]:
        @functools.wraps(handler)
        async def wrapped(
            self: Servicer, request: Request, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Response]:
            responses = handler(self, request, context)
            try:
                async for response in responses:
                    yield response
            except grpc.aio.AbortError:
                raise
            except ServiceError as error:
                await abort(context, error, handler.__name__)
            except Exception as error:
                await abort(context, internal_error(error, service, handler.__name__), handler.__name__)
            finally:
                # Closed however the call ends (a client that goes away included), not at garbage
                # collection: the handler's clean-up must run at once.
                close = getattr(responses, "aclose", None)
                if close is not None:
                    await close()

        return wrapped

    return decorate
