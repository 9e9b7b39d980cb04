"""The SDK's exceptions: every gRPC failure surfaces as a typed ``RpcError`` with the SDK's own code."""

from __future__ import annotations

import enum
from collections.abc import Sequence

import grpc


class ErrorCode(enum.Enum):
    """Why a call failed (the gRPC status codes, under the SDK's own names)."""

    CANCELLED = "cancelled"
    UNKNOWN = "unknown"
    INVALID_ARGUMENT = "invalid_argument"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    NOT_FOUND = "not_found"
    ALREADY_EXISTS = "already_exists"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    FAILED_PRECONDITION = "failed_precondition"
    ABORTED = "aborted"
    OUT_OF_RANGE = "out_of_range"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    UNAUTHENTICATED = "unauthenticated"


class KvferryError(Exception):
    """Base of every exception the SDK raises on purpose."""


class ConfigError(KvferryError):
    """The client cannot be configured as asked (missing address, unreadable certificate...)."""


class RpcError(KvferryError):
    """A call to the router failed.

    ``code`` says why; ``method`` names the RPC; ``chunks_received`` counts the stream events that had
    arrived before a Generate stream failed (a turn is never retried once one has arrived).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        method: str = "",
        chunks_received: int = 0,
        trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> None:
        self.code = code
        self.message = message
        self.method = method
        self.chunks_received = chunks_received
        self.trailing_metadata = tuple(trailing_metadata)
        where = f"{method}: " if method else ""
        super().__init__(f"{where}{code.name}: {message}")

    @property
    def retryable(self) -> bool:
        """Whether sending the same call again can succeed (only UNAVAILABLE, and only before any chunk)."""
        return self.code is ErrorCode.UNAVAILABLE and self.chunks_received == 0


class CallCancelledError(RpcError):
    """The call was cancelled (by the caller or the server)."""


class InvalidArgumentError(RpcError):
    """The request is malformed (bad conversation id, empty prompt...); fix the request."""


class DeadlineExceededError(RpcError):
    """The call's deadline passed; raise the deadline or retry later."""


class NotFoundError(RpcError):
    """Nothing is retained for the conversation (never started, expired, closed or released)."""


class AlreadyExistsError(RpcError):
    """The resource already exists."""


class PermissionDeniedError(RpcError):
    """The API key is valid but may not touch this conversation (another tenant's)."""


class ResourceExhaustedError(RpcError):
    """The router or its engines are over capacity; back off and retry."""


class FailedPreconditionError(RpcError):
    """The call is valid but the conversation's state does not allow it now."""


class AbortedError(RpcError):
    """The call conflicted with a concurrent one (e.g. two turns of one conversation at once)."""


class UnimplementedError(RpcError):
    """The router does not implement this call (version mismatch)."""


class InternalError(RpcError):
    """The router failed, or answered outside the protocol."""


class UnavailableError(RpcError):
    """The router (or what it needs) cannot be reached; retried automatically before any chunk arrived."""


class UnauthenticatedError(RpcError):
    """No API key, or an unknown one: pass ``api_key=`` or set KVFERRY_API_KEY."""


_ERROR_CLASSES: dict[ErrorCode, type[RpcError]] = {
    ErrorCode.CANCELLED: CallCancelledError,
    ErrorCode.INVALID_ARGUMENT: InvalidArgumentError,
    ErrorCode.OUT_OF_RANGE: InvalidArgumentError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.ALREADY_EXISTS: AlreadyExistsError,
    ErrorCode.PERMISSION_DENIED: PermissionDeniedError,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    ErrorCode.FAILED_PRECONDITION: FailedPreconditionError,
    ErrorCode.ABORTED: AbortedError,
    ErrorCode.UNIMPLEMENTED: UnimplementedError,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.DATA_LOSS: InternalError,
    ErrorCode.UNKNOWN: InternalError,
    ErrorCode.UNAVAILABLE: UnavailableError,
    ErrorCode.UNAUTHENTICATED: UnauthenticatedError,
}

_CODES_BY_STATUS: dict[grpc.StatusCode, ErrorCode] = {
    grpc.StatusCode.CANCELLED: ErrorCode.CANCELLED,
    grpc.StatusCode.UNKNOWN: ErrorCode.UNKNOWN,
    grpc.StatusCode.INVALID_ARGUMENT: ErrorCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND: ErrorCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS: ErrorCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED: ErrorCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED: ErrorCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE: ErrorCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED: ErrorCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL: ErrorCode.INTERNAL,
    grpc.StatusCode.UNAVAILABLE: ErrorCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS: ErrorCode.DATA_LOSS,
    grpc.StatusCode.UNAUTHENTICATED: ErrorCode.UNAUTHENTICATED,
}


def error_code_from_status(status: grpc.StatusCode | None) -> ErrorCode:
    """The SDK code for a gRPC status (an unexpected or missing status is UNKNOWN)."""
    if status is None:
        return ErrorCode.UNKNOWN
    return _CODES_BY_STATUS.get(status, ErrorCode.UNKNOWN)


def make_error(
    code: ErrorCode,
    message: str,
    *,
    method: str = "",
    chunks_received: int = 0,
    trailing_metadata: Sequence[tuple[str, str | bytes]] = (),
) -> RpcError:
    """The typed exception for ``code``."""
    cls = _ERROR_CLASSES.get(code, RpcError)
    return cls(
        code, message, method=method, chunks_received=chunks_received, trailing_metadata=trailing_metadata
    )


def error_from_rpc(error: grpc.RpcError, *, method: str, chunks_received: int = 0) -> RpcError:
    """Turns a failed gRPC call (``grpc.aio.AioRpcError``) into the SDK's typed exception."""
    status = error.code() if isinstance(error, grpc.aio.AioRpcError | grpc.Call) else None
    details = error.details() if isinstance(error, grpc.aio.AioRpcError | grpc.Call) else None
    metadata: Sequence[tuple[str, str | bytes]] = ()
    if isinstance(error, grpc.aio.AioRpcError):
        metadata = tuple((key, value) for key, value in (error.trailing_metadata() or ()))
    code = error_code_from_status(status)
    return make_error(
        code,
        details or f"the router answered {code.name} without details",
        method=method,
        chunks_received=chunks_received,
        trailing_metadata=metadata,
    )
