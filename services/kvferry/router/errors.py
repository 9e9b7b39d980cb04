"""The router's one exception type and its mapping to gRPC status codes and HTTP responses.

Domain code raises :class:`RouterError` with a :class:`Failure` kind and a message the caller can act
on; the gRPC and HTTP layers translate it through the tables below and nowhere else.
"""

from __future__ import annotations

import enum
import logging

import grpc

log = logging.getLogger(__name__)


class Failure(enum.Enum):
    """What went wrong, independent of the protocol that reports it."""

    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


class RouterError(Exception):
    """A failure the router reports to its client as-is."""

    def __init__(self, failure: Failure, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message
        # The request field at fault (OpenAI error bodies carry it).
        self.param = param


GRPC_CODES: dict[Failure, grpc.StatusCode] = {
    Failure.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Failure.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Failure.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Failure.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
}

# (HTTP status, OpenAI error `type`)
HTTP_STATUSES: dict[Failure, tuple[int, str]] = {
    Failure.UNAUTHENTICATED: (401, "authentication_error"),
    Failure.PERMISSION_DENIED: (403, "permission_error"),
    Failure.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Failure.NOT_FOUND: (404, "not_found_error"),
    Failure.UNAVAILABLE: (503, "service_unavailable"),
    Failure.DEADLINE_EXCEEDED: (504, "timeout"),
    Failure.INTERNAL: (500, "internal_error"),
}


def invalid(message: str, *, param: str | None = None) -> RouterError:
    return RouterError(Failure.INVALID_ARGUMENT, message, param=param)


def unavailable(message: str) -> RouterError:
    return RouterError(Failure.UNAVAILABLE, message)


def internal(error: BaseException, where: str) -> RouterError:
    """A bug's report to the client: logged here with its traceback, named plainly there."""
    log.error("internal error", exc_info=error, extra={"where": where})
    return RouterError(
        Failure.INTERNAL,
        f"internal error in the router ({where}: {type(error).__name__}); see the router's log",
    )
