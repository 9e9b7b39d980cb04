"""ReportRetention and EndRetention (EvictRetention): the connector's retentions published to, and ended
in, the registry.

A report is tracked in the book before its publish is sent (so a SYNC built meanwhile lists it) and
settled by the registry's answer. An end the engine starts goes to the registry's
EndEngineRetention, which ends the record only if it is still that request and keeps the request
from ever being published again: its success is the confirmation the connector waits for before
starting the grace after which it frees the blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from kvferry.runtime.errors import (
    ErrorKind,
    Internal,
    InvalidArgument,
    ServiceError,
    Unavailable,
    error_of_kind,
)
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registry_link import AMBIGUOUS_KINDS, TRANSIENT_KINDS, RegistryApi, RegistryError
from kvferry.sidecar.releases import ReleaseFanout, RetentionBook
from kvferry.v1 import resources_pb2

log = logging.getLogger("kvferry.sidecar.retentions")

_HARD_CAP_HINT = "the connector keeps the blocks until its hard cap"

# Registry refusals passed on as the same kind; the registry's message says what to fix.
_PASSED_ON = frozenset(
    {
        ErrorKind.INVALID_ARGUMENT,
        ErrorKind.FAILED_PRECONDITION,
        ErrorKind.ALREADY_EXISTS,
        ErrorKind.PERMISSION_DENIED,
        ErrorKind.UNAUTHENTICATED,
        ErrorKind.OUT_OF_RANGE,
    }
)


class RegistrationState(Protocol):
    """What publishing needs from the engine's registration."""

    @property
    def registered(self) -> bool: ...

    @property
    def generation(self) -> int: ...

    @property
    def incarnation(self) -> int:
        """The registration publishes name (the registry refuses them from another one)."""
        ...

    def check_lease(self, generation: int) -> None: ...


@dataclass(frozen=True)
class Reported:
    """A retention as the registry stored it, and the registry revision it is known at."""

    retention: resources_pb2.Retention
    revision: int


@dataclass(frozen=True)
class Ended:
    """An end the engine asked for, confirmed: whether it ended the live record, and at which revision."""

    ended: bool
    revision: int


class RetentionPublisher:
    def __init__(
        self,
        engine_id: str,
        registry: RegistryApi,
        registration: RegistrationState,
        fanout: ReleaseFanout,
        metrics: SidecarMetrics,
    ) -> None:
        self.engine_id = engine_id
        self._registry = registry
        self._registration = registration
        self._fanout = fanout
        self._book: RetentionBook = fanout.book
        self._metrics = metrics

    async def report(self, retention: resources_pb2.Retention) -> Reported:
        """Publishes ``retention`` for this engine; returns it as stored (with its expiry)."""
        try:
            stored = await self._publish(retention)
        except ServiceError as err:
            self._metrics.publish_failures.labels(code=err.kind.name).inc()
            log.warning(
                "retention not published",
                extra={
                    "engine_request_id": retention.engine_request_id,
                    "conversation_id": retention.conversation_id,
                    "code": err.kind.name,
                    "error": err.message,
                },
            )
            raise
        self._metrics.publishes.inc()
        return stored

    async def _publish(self, retention: resources_pb2.Retention) -> Reported:
        if retention.engine_id and retention.engine_id != self.engine_id:
            raise InvalidArgument(
                f"retention names engine {retention.engine_id!r} but this sidecar serves {self.engine_id!r}; "
                "point the connector at its own engine's sidecar",
            )
        if not retention.engine_request_id:
            raise InvalidArgument("retention.engine_request_id is required")
        if not self._registration.registered:
            raise Unavailable(
                f"engine {self.engine_id!r} is not registered with the registry right now; {_HARD_CAP_HINT}",
            )
        to_publish = resources_pb2.Retention()
        to_publish.CopyFrom(retention)
        to_publish.engine_id = self.engine_id
        generation = self._registration.generation
        request_id = to_publish.engine_request_id
        # In the book before the publish is sent: a SYNC built meanwhile lists it (see releases.py).
        self._book.track(to_publish, confirmed=False, publishing=True)
        try:
            response = await self._registry.publish_retention(to_publish, self._registration.incarnation)
        except RegistryError as err:
            if err.kind in AMBIGUOUS_KINDS:
                found = await self._stored_despite(to_publish, err)
                if found is not None:
                    return found
            else:
                self._book.published(request_id, None)
            raise self._failure(err, generation) from err
        except BaseException:
            self._book.published(request_id, None)
            raise
        stored = response.retention
        if not stored.engine_request_id:
            stored = to_publish
        self._book.published(request_id, stored, revision=response.header.revision)
        return Reported(stored, response.header.revision)

    async def _stored_despite(
        self, retention: resources_pb2.Retention, err: RegistryError
    ) -> Reported | None:
        """After a publish whose outcome is unknown: the stored retention if it did land.

        Otherwise the retention stays in the book unconfirmed: SYNCs keep listing it (never freeing
        blocks the registry may hand out) until a sweep settles it.
        """
        request_id = retention.engine_request_id
        try:
            found = await self._registry.get_retention(retention.tenant, retention.conversation_id)
        except RegistryError:
            self._book.published(request_id, None, may_have_landed=True)
            return None
        live = found.retention
        if live.engine_request_id == request_id and live.engine_id == self.engine_id:
            log.info("publish landed despite a failed answer", extra={"error": str(err)})
            self._book.published(request_id, live, revision=found.header.revision)
            return Reported(live, found.header.revision)
        self._book.published(request_id, None, may_have_landed=True)
        return None

    def _failure(self, err: RegistryError, generation: int) -> ServiceError:
        if err.kind is ErrorKind.NOT_FOUND or (
            err.kind is ErrorKind.FAILED_PRECONDITION
            and ("is not registered" in err.message or "registered under incarnation" in err.message)
        ):
            # The registry refuses retentions of unknown engines: the engine's lease may be gone.
            self._registration.check_lease(generation)
            return Unavailable(
                f"the registry does not know engine {self.engine_id!r} (its lease was lost; the sidecar is "
                f"re-registering it): {err.message}; {_HARD_CAP_HINT}",
            )
        if err.kind in _PASSED_ON:
            return error_of_kind(err.kind, f"the registry refused the retention: {err.message}")
        if err.kind in TRANSIENT_KINDS:
            return Unavailable(
                f"registry unreachable ({err.kind.name}: {err.message}); retention not published; "
                f"{_HARD_CAP_HINT}",
            )
        return Internal(f"registry failed the publish: {err}")

    async def end(
        self,
        tenant: str,
        conversation_id: str,
        engine_request_id: str,
        reason: resources_pb2.ReleaseReason.ValueType,
    ) -> Ended:
        """Ends this engine's retention ``engine_request_id`` in the registry (only if it is still live
        there, never a newer turn) and keeps it from being published again. Returns once confirmed."""
        for name, value in (
            ("tenant", tenant),
            ("conversation_id", conversation_id),
            ("engine_request_id", engine_request_id),
        ):
            if not value:
                raise InvalidArgument(f"{name} is required")
        if reason == resources_pb2.RELEASE_REASON_EVICTED:
            self._metrics.evictions.inc()
        try:
            response = await self._registry.end_engine_retention(
                tenant, conversation_id, self.engine_id, engine_request_id, reason
            )
        except RegistryError as err:
            if err.kind in _PASSED_ON:
                raise error_of_kind(err.kind, f"the registry refused the end: {err.message}") from err
            raise Unavailable(
                f"registry unreachable ({err.kind.name}: {err.message}); retention not ended yet; "
                f"{_HARD_CAP_HINT}",
            ) from err
        revision = response.header.revision
        # Every connector stream hears it (the registry's own ENDED event, if any, is then a repeat).
        self._fanout.end(engine_request_id, reason or resources_pb2.RELEASE_REASON_RELEASED, revision)
        log.info(
            "retention ended by its engine",
            extra={
                "conversation_id": conversation_id,
                "engine_request_id": engine_request_id,
                "reason": resources_pb2.ReleaseReason.Name(reason),
                "was_live": response.ended,
                "revision": revision,
            },
        )
        return Ended(response.ended, revision)
