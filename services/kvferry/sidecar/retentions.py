"""ReportRetention and EvictRetention: the connector's retentions published to (and ended in) the registry."""

from __future__ import annotations

import logging
from typing import Protocol

import grpc
from kvferry.sidecar.errors import SidecarError
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registry_link import AMBIGUOUS_CODES, TRANSIENT_CODES, RegistryApi, RegistryError
from kvferry.sidecar.releases import RetentionBook
from kvferry.v1 import resources_pb2

log = logging.getLogger("kvferry.sidecar.retentions")

_HARD_CAP_HINT = "the connector keeps the blocks until its hard cap"

# Registry refusals passed on with the same code; the registry's message says what to fix.
_PASSED_ON = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


class RegistrationState(Protocol):
    """What publishing needs from the engine's registration."""

    @property
    def registered(self) -> bool: ...

    @property
    def generation(self) -> int: ...

    def check_lease(self, generation: int) -> None: ...


class RetentionPublisher:
    def __init__(
        self,
        engine_id: str,
        registry: RegistryApi,
        registration: RegistrationState,
        book: RetentionBook,
        metrics: SidecarMetrics,
    ) -> None:
        self.engine_id = engine_id
        self._registry = registry
        self._registration = registration
        self._book = book
        self._metrics = metrics

    async def report(self, retention: resources_pb2.Retention) -> resources_pb2.Retention:
        """Publishes ``retention`` for this engine; returns it as stored (with its expiry)."""
        try:
            stored = await self._publish(retention)
        except SidecarError as err:
            self._metrics.publish_failures.labels(code=err.code.name).inc()
            log.warning(
                "retention not published",
                extra={
                    "engine_request_id": retention.engine_request_id,
                    "conversation_id": retention.conversation_id,
                    "code": err.code.name,
                    "error": err.message,
                },
            )
            raise
        self._metrics.publishes.inc()
        return stored

    async def _publish(self, retention: resources_pb2.Retention) -> resources_pb2.Retention:
        if retention.engine_id and retention.engine_id != self.engine_id:
            raise SidecarError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"retention names engine {retention.engine_id!r} but this sidecar serves {self.engine_id!r}; "
                "point the connector at its own engine's sidecar",
            )
        if not retention.engine_request_id:
            raise SidecarError(grpc.StatusCode.INVALID_ARGUMENT, "retention.engine_request_id is required")
        if not self._registration.registered:
            raise SidecarError(
                grpc.StatusCode.UNAVAILABLE,
                f"engine {self.engine_id!r} is not registered with the registry right now; {_HARD_CAP_HINT}",
            )
        to_publish = resources_pb2.Retention()
        to_publish.CopyFrom(retention)
        to_publish.engine_id = self.engine_id
        generation = self._registration.generation
        try:
            response = await self._registry.publish_retention(to_publish)
        except RegistryError as err:
            if err.code in AMBIGUOUS_CODES:
                stored = await self._stored_despite(to_publish, err)
                if stored is not None:
                    return stored
            raise self._failure(err, generation) from err
        stored = response.retention
        if not stored.engine_request_id:
            stored = to_publish
        self._book.track(stored)
        return stored

    async def _stored_despite(
        self, retention: resources_pb2.Retention, err: RegistryError
    ) -> resources_pb2.Retention | None:
        """After a publish whose outcome is unknown: the stored retention if it did land.

        If even that cannot be asked, the retention is tracked unconfirmed: the next SYNC keeps
        it live (never freeing blocks the registry may hand out) until a sweep settles it.
        """
        try:
            live = await self._registry.get_retention(retention.tenant, retention.conversation_id)
        except RegistryError as check_err:
            if check_err.code is not grpc.StatusCode.NOT_FOUND:
                self._book.track(retention, confirmed=False)
            return None
        if live.engine_request_id == retention.engine_request_id and live.engine_id == self.engine_id:
            log.info("publish landed despite a failed answer", extra={"error": str(err)})
            self._book.track(live)
            return live
        return None

    def _failure(self, err: RegistryError, generation: int) -> SidecarError:
        if err.code is grpc.StatusCode.NOT_FOUND or (
            err.code is grpc.StatusCode.FAILED_PRECONDITION and "is not registered" in err.message
        ):
            # The registry refuses retentions of unknown engines: the engine's lease may be gone.
            self._registration.check_lease(generation)
            return SidecarError(
                grpc.StatusCode.UNAVAILABLE,
                f"the registry does not know engine {self.engine_id!r} (its lease was lost; the sidecar is "
                f"re-registering it): {err.message}; {_HARD_CAP_HINT}",
            )
        if err.code in _PASSED_ON:
            return SidecarError(err.code, f"the registry refused the retention: {err.message}")
        if err.code in TRANSIENT_CODES:
            return SidecarError(
                grpc.StatusCode.UNAVAILABLE,
                f"registry unreachable ({err.code.name}: {err.message}); retention not published; "
                f"{_HARD_CAP_HINT}",
            )
        return SidecarError(grpc.StatusCode.INTERNAL, f"registry failed the publish: {err}")

    async def evict(self, tenant: str, conversation_id: str, engine_request_id: str) -> bool:
        """Ends the conversation's retention with EVICTED if it is still ``engine_request_id`` on this
        engine; True if it did, False if there was nothing of ours to end (already ended, or a newer turn)."""
        for name, value in (
            ("tenant", tenant),
            ("conversation_id", conversation_id),
            ("engine_request_id", engine_request_id),
        ):
            if not value:
                raise SidecarError(grpc.StatusCode.INVALID_ARGUMENT, f"{name} is required")
        self._metrics.evictions.inc()
        try:
            # The lookup keeps other engines' retentions out of reach (the guard names only the
            # request) and spares a write when there is nothing of ours to end.
            live = await self._registry.get_retention(tenant, conversation_id)
            if live.engine_request_id != engine_request_id or live.engine_id != self.engine_id:
                return False
            # The registry re-checks the request inside its release transaction, so a newer turn
            # published since the lookup is refused (FAILED_PRECONDITION), never evicted.
            await self._registry.release_retention(
                tenant,
                conversation_id,
                resources_pb2.RELEASE_REASON_EVICTED,
                engine_request_id=engine_request_id,
            )
        except RegistryError as err:
            if err.code is grpc.StatusCode.NOT_FOUND:
                return False
            if err.code is grpc.StatusCode.FAILED_PRECONDITION:
                log.info(
                    "retention not evicted: a newer turn replaced it",
                    extra={"conversation_id": conversation_id, "engine_request_id": engine_request_id},
                )
                return False
            if err.code in _PASSED_ON:
                raise SidecarError(err.code, f"the registry refused the eviction: {err.message}") from err
            raise SidecarError(
                grpc.StatusCode.UNAVAILABLE,
                f"registry unreachable ({err.code.name}: {err.message}); retention not evicted; "
                f"{_HARD_CAP_HINT}",
            ) from err
        log.info(
            "retention evicted",
            extra={"conversation_id": conversation_id, "engine_request_id": engine_request_id},
        )
        return True
