"""The registry's domain errors and the one table that turns them into gRPC statuses."""

from __future__ import annotations

import grpc


class RegistryError(Exception):
    """Base of every error the registry reports to a caller; the message says what to do."""


class InvalidArgument(RegistryError):
    """The request itself is malformed (bad id, TTL out of range, digests not matching blocks)."""


class NotFound(RegistryError):
    """The engine or retention does not exist (never did, ended, or its lease ran out)."""


class FailedPrecondition(RegistryError):
    """The request is well-formed but the registry's state refuses it (unknown engine, stale turn)."""


class Conflict(RegistryError):
    """A concurrent change won the race more than the retry budget allows; retrying may succeed."""


class EtcdUnavailable(RegistryError):
    """etcd did not answer within the deadline or refused the connection."""


class EtcdFailure(RegistryError):
    """etcd answered with an error the registry does not expect (a bug or a misconfigured etcd)."""


STATUS_BY_ERROR: dict[type[RegistryError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    Conflict: grpc.StatusCode.ABORTED,
    EtcdUnavailable: grpc.StatusCode.UNAVAILABLE,
    EtcdFailure: grpc.StatusCode.INTERNAL,
}


def status_for(error: RegistryError) -> grpc.StatusCode:
    """The gRPC status of ``error`` (its class or the nearest base listed in the table)."""
    for cls in type(error).__mro__:
        code = STATUS_BY_ERROR.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL
