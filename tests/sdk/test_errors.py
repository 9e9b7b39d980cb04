"""Error mapping: every gRPC status becomes the SDK's typed exception with its own code."""

from __future__ import annotations

import grpc
import pytest
from kvferry.sdk import (
    CallCancelledError,
    DeadlineExceededError,
    ErrorCode,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RpcError,
    UnauthenticatedError,
    UnavailableError,
)
from kvferry.sdk._errors import error_code_from_status, error_from_rpc, make_error


def _aio_error(code: grpc.StatusCode, details: str | None) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(("x-reason", "test")), details=details
    )


def test_every_status_but_ok_has_a_code() -> None:
    for status in grpc.StatusCode:
        if status is grpc.StatusCode.OK:
            continue
        assert error_code_from_status(status).name == status.name


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError),
        (grpc.StatusCode.NOT_FOUND, NotFoundError),
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
        (grpc.StatusCode.CANCELLED, CallCancelledError),
        (grpc.StatusCode.INTERNAL, InternalError),
        (grpc.StatusCode.UNKNOWN, InternalError),
    ],
)
def test_aio_error_becomes_typed_exception(status: grpc.StatusCode, cls: type[RpcError]) -> None:
    error = error_from_rpc(_aio_error(status, "why it failed"), method="kvferry.v1.RouterService/Generate")
    assert type(error) is cls
    assert error.code.name == status.name
    assert error.message == "why it failed"
    assert error.method == "kvferry.v1.RouterService/Generate"
    assert ("x-reason", "test") in error.trailing_metadata
    assert "kvferry.v1.RouterService/Generate" in str(error) and status.name in str(error)


def test_missing_details_still_says_something() -> None:
    error = error_from_rpc(_aio_error(grpc.StatusCode.INTERNAL, None), method="m")
    assert "INTERNAL" in error.message


def test_only_unavailable_before_any_chunk_is_retryable() -> None:
    assert make_error(ErrorCode.UNAVAILABLE, "down").retryable
    assert not make_error(ErrorCode.UNAVAILABLE, "lost", chunks_received=3).retryable
    assert not make_error(ErrorCode.DEADLINE_EXCEEDED, "slow").retryable
    assert not make_error(ErrorCode.RESOURCE_EXHAUSTED, "busy").retryable
