"""Per-tenant limits on the router's turns (pure: no I/O; the clock is injected).

One tenant's burst must not take the router from the others:

- each tenant may have at most ``max_concurrent_turns`` turns in flight on this router (its gRPC and HTTP
  front doors together);
- each tenant may spend ``tokens_per_second`` tokens (prompt plus generated) on this router, from a token
  bucket holding ``token_burst_seconds`` of them: a turn is admitted while the tenant's bucket is not
  empty, its prompt tokens are taken once tokenized and its generated tokens when it ends. A bucket may go
  into debt by one turn's tokens (a turn's size is not known when it is admitted); the next turns wait for
  the refill. A tenant's own ``tokens_per_second`` (tenants file) overrides the router's default.

A turn past a cap is refused at once, before any registry or engine call, with RESOURCE_EXHAUSTED (HTTP
429) and a Retry-After; refusing instead of queueing keeps the caller in charge of its backoff and the
router's memory bounded. The caps are per router process: N replicas admit up to N times them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvferry.router.tenants import Tenant
from kvferry.runtime.errors import ResourceExhausted


@dataclass(frozen=True)
class TenantLimitSettings:
    # Turns one tenant may have in flight on this router; 0: no cap.
    max_concurrent_turns: int = 0
    # Tokens (prompt plus generated) one tenant may spend per second on this router, unless its entry in
    # the tenants file says otherwise; 0: no cap.
    tokens_per_second: float = 0.0
    # The bucket holds this many seconds of tokens: what an idle tenant may spend at once.
    token_burst_seconds: float = 10.0
    # What a refused caller is told to wait at least, in whole seconds (HTTP Retry-After).
    retry_after_seconds: int = 1

    def __post_init__(self) -> None:
        if self.max_concurrent_turns < 0:
            raise ValueError("max concurrent turns per tenant cannot be negative (0: no cap)")
        if not math.isfinite(self.tokens_per_second) or self.tokens_per_second < 0:
            raise ValueError("tokens per second per tenant must be a finite number >= 0 (0: no cap)")
        if not math.isfinite(self.token_burst_seconds) or self.token_burst_seconds <= 0:
            raise ValueError("the token burst must be a positive number of seconds")
        if self.retry_after_seconds < 1:
            raise ValueError("retry-after must be at least 1 s")


class TokenBucket:
    """``rate`` tokens per second accrue up to ``capacity``; taking may leave it in debt (below zero)."""

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self._level = capacity
        self._updated = now

    def level(self, now: float) -> float:
        if now > self._updated:
            self._level = min(self.capacity, self._level + (now - self._updated) * self.rate)
            self._updated = now
        return self._level

    def take(self, tokens: int, now: float) -> None:
        self._level = self.level(now) - tokens

    def empty_for(self, now: float) -> float | None:
        """None while some tokens are left; else how long until the refill has paid the debt (0: it just
        has, and the bucket is exactly empty)."""
        level = self.level(now)
        return None if level > 0 else -level / self.rate


class TurnSlot:
    """One admitted turn: :meth:`charge` takes its tokens from its tenant's bucket; :meth:`release`
    (idempotent) gives the slot back."""

    def __init__(
        self, limits: TenantLimits, tenant: str, *, counted: bool, bucket: TokenBucket | None
    ) -> None:
        self._limits: TenantLimits | None = limits if counted else None
        self._clock = limits.clock
        self._tenant = tenant
        self._bucket = bucket

    def charge(self, tokens: int) -> None:
        """Takes ``tokens`` (the prompt's, then the generated ones) from the tenant's bucket."""
        if self._bucket is not None and tokens > 0:
            self._bucket.take(tokens, self._clock())

    def release(self) -> None:
        if self._limits is not None:
            self._limits._release(self._tenant)
            self._limits = None


class TenantLimits:
    """Counts each tenant's turns in flight and tokens spent, and refuses a turn past a cap."""

    def __init__(self, settings: TenantLimitSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._in_flight: dict[str, int] = {}
        self._buckets: dict[str, TokenBucket] = {}

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def tokens_left(self, tenant: Tenant) -> float | None:
        """What is left in ``tenant``'s bucket now (negative: in debt); None when it has no token cap."""
        bucket = self._bucket(tenant)
        return bucket.level(self.clock()) if bucket is not None else None

    def refuses(self, tenant: Tenant) -> bool:
        """Whether :meth:`admit` would refuse a turn of ``tenant`` now (it takes nothing)."""
        return self._refusal(tenant) is not None

    def admit(self, tenant: Tenant) -> TurnSlot:
        """A slot for one turn of ``tenant``; ResourceExhausted (with retry-after) when it has as many
        turns in flight as its cap, or its token bucket is empty."""
        refusal = self._refusal(tenant)
        if refusal is not None:
            raise refusal
        bucket = self._bucket(tenant)
        if not self.settings.max_concurrent_turns:
            return TurnSlot(self, tenant.name, counted=False, bucket=bucket)
        self._in_flight[tenant.name] = self._in_flight.get(tenant.name, 0) + 1
        return TurnSlot(self, tenant.name, counted=True, bucket=bucket)

    def _refusal(self, tenant: Tenant) -> ResourceExhausted | None:
        name = tenant.name
        bucket = self._bucket(tenant)
        if bucket is not None:
            wait = bucket.empty_for(self.clock())
            if wait is not None:
                retry = max(self.settings.retry_after_seconds, math.ceil(wait))
                return ResourceExhausted(
                    f"tenant {name} spent its {bucket.rate:g} tokens per second (prompt plus generated) on "
                    f"this router; retry after {retry} s, or send shorter turns less often",
                    retry_after_seconds=retry,
                )
        cap = self.settings.max_concurrent_turns
        running = self._in_flight.get(name, 0)
        if cap and running >= cap:
            return ResourceExhausted(
                f"tenant {name} has {running} turns in flight, its limit on this router; retry after "
                f"{self.settings.retry_after_seconds} s, or run fewer turns at once",
                retry_after_seconds=self.settings.retry_after_seconds,
            )
        return None

    def _bucket(self, tenant: Tenant) -> TokenBucket | None:
        rate = (
            self.settings.tokens_per_second if tenant.tokens_per_second is None else tenant.tokens_per_second
        )
        if not rate:
            return None
        bucket = self._buckets.get(tenant.name)
        if bucket is None or bucket.rate != rate:
            bucket = TokenBucket(rate, rate * self.settings.token_burst_seconds, self.clock())
            self._buckets[tenant.name] = bucket
        return bucket

    def _release(self, tenant: str) -> None:
        left = self._in_flight[tenant] - 1
        if left:
            self._in_flight[tenant] = left
        else:
            del self._in_flight[tenant]
