"""Per-tenant limits on the router's turns (pure: no I/O, no clock).

One tenant's burst must not take the router from the others: each tenant may have at most
``max_concurrent_turns`` turns in flight on this router (its gRPC and HTTP front doors together). A turn
past the cap is refused at once, before any registry or engine call, with RESOURCE_EXHAUSTED (HTTP 429)
and a Retry-After; refusing instead of queueing keeps the caller in charge of its backoff and the router's
memory bounded. The cap is per router process: N replicas admit up to N times it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.runtime.errors import ResourceExhausted


@dataclass(frozen=True)
class TenantLimitSettings:
    # Turns one tenant may have in flight on this router; 0: no cap.
    max_concurrent_turns: int = 0
    # What a refused caller is told to wait, in whole seconds (HTTP Retry-After).
    retry_after_seconds: int = 1

    def __post_init__(self) -> None:
        if self.max_concurrent_turns < 0:
            raise ValueError("max concurrent turns per tenant cannot be negative (0: no cap)")
        if self.retry_after_seconds < 1:
            raise ValueError("retry-after must be at least 1 s")


class TurnSlot:
    """One admitted turn; :meth:`release` (idempotent) gives the slot back."""

    def __init__(self, limits: TenantLimits | None, tenant: str) -> None:
        self._limits = limits
        self._tenant = tenant

    def release(self) -> None:
        if self._limits is not None:
            self._limits._release(self._tenant)
            self._limits = None


class TenantLimits:
    """Counts each tenant's turns in flight and refuses one past the cap."""

    def __init__(self, settings: TenantLimitSettings) -> None:
        self.settings = settings
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def admit(self, tenant: str) -> TurnSlot:
        """A slot for one turn of ``tenant``; ResourceExhausted (with retry-after) when it has the cap."""
        cap = self.settings.max_concurrent_turns
        if not cap:
            return TurnSlot(None, tenant)
        running = self._in_flight.get(tenant, 0)
        if running >= cap:
            raise ResourceExhausted(
                f"tenant {tenant} has {running} turns in flight, its limit on this router; retry after "
                f"{self.settings.retry_after_seconds} s, or run fewer turns at once",
                retry_after_seconds=self.settings.retry_after_seconds,
            )
        self._in_flight[tenant] = running + 1
        return TurnSlot(self, tenant)

    def _release(self, tenant: str) -> None:
        left = self._in_flight[tenant] - 1
        if left:
            self._in_flight[tenant] = left
        else:
            del self._in_flight[tenant]
