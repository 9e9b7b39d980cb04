"""The engine's registration in the registry, as a state machine driven by one asyncio task.

WAITING_FOR_ENGINE -> (engine /health OK, facts read) -> REGISTERING -> REGISTERED
REGISTERED -> heartbeat every granted TTL / 3, carrying the connector's latest EngineStats (and the
    engine's release grace, at once, when the connector said it only after the registration)
REGISTERED -> (heartbeat NOT_FOUND: the lease was lost) -> REGISTERING again, on its own
REGISTERED -> (the registry's revisions went back: etcd restored from an older snapshot) ->
    REGISTERING again, telling the registry the revision it saw (a new epoch starts)

Every RegisterEngine starts a fresh engine incarnation in the registry, which ends whatever the
previous incarnation retained (ENGINE_GONE). That is what makes the connector's first SYNC after
a (re-)registration true: this sidecar, even freshly restarted, knows every live retention.
REGISTERED -> (engine DOWN) -> deregister -> WAITING_FOR_ENGINE
any -> (shutdown) -> deregister -> STOPPED

Transient registry failures (unavailable, deadline) are retried with backoff and never end the
loop; only a registry that refuses the engine outright (bad config) raises RegistrationRejected.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.runtime.backoff import Backoff, BackoffPolicy
from kvferry.runtime.clock import Clock
from kvferry.runtime.errors import ErrorKind
from kvferry.sidecar.engine import EngineFacts, EngineMonitor, EngineProbe, EngineProbeError, EngineState
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registry_link import RegistryApi, RegistryError
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2

log = logging.getLogger("kvferry.sidecar.registration")

# A registry answering these to RegisterEngine will answer them again: the configuration is wrong.
_REJECTING_KINDS = frozenset(
    {
        ErrorKind.INVALID_ARGUMENT,
        ErrorKind.ALREADY_EXISTS,
        ErrorKind.FAILED_PRECONDITION,
        ErrorKind.PERMISSION_DENIED,
        ErrorKind.UNAUTHENTICATED,
        ErrorKind.UNIMPLEMENTED,
        ErrorKind.OUT_OF_RANGE,
    }
)


class Phase(enum.Enum):
    WAITING_FOR_ENGINE = "waiting_for_engine"
    REGISTERING = "registering"
    REGISTERED = "registered"
    STOPPED = "stopped"


class RegistrationRejected(Exception):
    """The registry refused the engine for a reason retrying cannot fix."""


@dataclass(frozen=True)
class EngineIdentity:
    """What the sidecar knows about its engine from flags; None fields come from the engine itself."""

    engine_id: str
    role: resources_pb2.EngineRole.ValueType
    http_endpoint: str
    nixl_host: str
    nixl_port: int
    kv_compatibility_hash: str
    model: str | None = None
    block_size: int | None = None
    kv_capacity_blocks: int | None = None
    max_model_len: int | None = None


@dataclass(frozen=True)
class RegistrationSettings:
    # Lease length asked for; 0 takes the registry's default.
    ttl_seconds: int = 10
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)


class _Outcome(enum.Enum):
    LEASE_LOST = "lease_lost"
    ENGINE_DOWN = "engine_down"


def describe_engine(
    identity: EngineIdentity, facts: EngineFacts, release_grace_seconds: float = 0.0
) -> resources_pb2.Engine:
    """The Engine record to register: flags win over what the engine reports, both are checked.
    ``release_grace_seconds``: what the engine's connector said (0: nothing yet)."""

    def pick(name: str, flag: int | str | None, reported: int | str | None, flag_name: str) -> int | str:
        if flag is not None and reported is not None and flag != reported:
            log.warning(
                "flag overrides what the engine reports",
                extra={"field": name, "flag": flag, "engine_reports": reported},
            )
        value = flag if flag is not None else reported
        if value is None:
            raise RegistrationRejected(
                f"the engine at {identity.http_endpoint} does not report its {name}; pass {flag_name}"
            )
        return value

    return resources_pb2.Engine(
        engine_id=identity.engine_id,
        role=identity.role,
        http_endpoint=identity.http_endpoint,
        nixl_host=identity.nixl_host,
        nixl_port=identity.nixl_port,
        model=str(pick("model", identity.model, facts.model, "--model")),
        kv_compatibility_hash=identity.kv_compatibility_hash,
        block_size=int(pick("block size", identity.block_size, facts.block_size, "--block-size")),
        kv_capacity_blocks=int(
            pick("KV capacity", identity.kv_capacity_blocks, facts.kv_capacity_blocks, "--kv-capacity-blocks")
        ),
        max_model_len=int(
            pick("max_model_len", identity.max_model_len, facts.max_model_len, "--max-model-len")
        ),
        release_grace_seconds=release_grace_seconds,
    )


class EngineRegistration:
    """Keeps the engine registered while it is up; see the module docstring for the states."""

    def __init__(
        self,
        identity: EngineIdentity,
        registry: RegistryApi,
        monitor: EngineMonitor,
        probe: EngineProbe,
        clock: Clock,
        metrics: SidecarMetrics,
        settings: RegistrationSettings,
        *,
        on_change: Callable[[], None] = lambda: None,
        on_deregistered: Callable[[], None] = lambda: None,
    ) -> None:
        self.identity = identity
        self._registry = registry
        self._monitor = monitor
        self._probe = probe
        self._clock = clock
        self._metrics = metrics
        self._settings = settings
        self._on_change = on_change
        self._on_deregistered = on_deregistered
        self.phase = Phase.WAITING_FOR_ENGINE
        # Bumped by every successful registration; watchers restart when it moves.
        self.generation = 0
        self.link_up = False
        self.granted_ttl_seconds = 0
        self.last_heartbeat_time: float | None = None
        self.engine: resources_pb2.Engine | None = None
        # The live registration (heartbeats name it) and the registry's epoch it was made in.
        self.incarnation = 0
        self.epoch = ""
        # The highest revision seen before the registry's revisions went back; 0: no rewind pending.
        self._rewind_evidence = 0
        # A retention the engine ended that the registry served again; None: none pending.
        self._ended_evidence: registry_pb2.EndedRetention | None = None
        self._stats: resources_pb2.EngineStats | None = None
        # The engine's release grace, as its connector said it (0: not yet); published with the
        # registration, or by the next heartbeat when it came (or changed) after it.
        self.release_grace_seconds = 0.0
        self._grace_unpublished = False
        # The stats the last heartbeat carried.
        self._stats_sent: resources_pb2.EngineStats | None = None
        self._wake = asyncio.Event()
        self._pulse = asyncio.Event()
        self._outage_logged = False

    # ---- what other parts read or signal -------------------------------------------------

    @property
    def registered(self) -> bool:
        return self.phase is Phase.REGISTERED

    @property
    def heartbeat_interval_seconds(self) -> float:
        return max(self.granted_ttl_seconds, 1) / 3.0

    def update_stats(self, stats: resources_pb2.EngineStats) -> None:
        """The connector's latest rates; the next heartbeat carries them, at once when a rate the
        router decides on changed (the connector reports those early, when they moved)."""
        self._stats = stats
        if self.phase is Phase.REGISTERED and _decision_rates(stats) != _decision_rates(self._stats_sent):
            self._wake.set()

    def set_release_grace(self, seconds: float) -> None:
        """The engine's release grace, as its connector says it (on every link to this sidecar). A
        change after the registration goes out with a heartbeat now."""
        if seconds == self.release_grace_seconds:
            return
        log.info(
            "engine release grace",
            extra={
                "engine_id": self.identity.engine_id,
                "release_grace_seconds": seconds,
                "was": self.release_grace_seconds,
            },
        )
        self.release_grace_seconds = seconds
        if self.phase is Phase.REGISTERED:
            self._grace_unpublished = True
            self._wake.set()

    def poke(self) -> None:
        """Wakes the loop early (the engine's state changed)."""
        self._wake.set()

    def check_lease(self, generation: int) -> None:
        """Another call suggests the registry lost registration ``generation``: heartbeat now, and
        re-register if the registry confirms (NOT_FOUND)."""
        if generation == self.generation and self.phase is Phase.REGISTERED:
            self._wake.set()

    def rewound(self, seen_revision: int, revision: int) -> None:
        """The registry answered at ``revision`` after this sidecar saw ``seen_revision``: etcd went
        back in time. The registration is registered again, with that evidence."""
        log.error(
            "the registry's revisions went back (etcd restored from an older snapshot?); registering again",
            extra={
                "engine_id": self.identity.engine_id,
                "seen_revision": seen_revision,
                "revision": revision,
            },
        )
        self._rewind_evidence = max(self._rewind_evidence, seen_revision)
        self._wake.set()

    def served_after_end(self, ended: registry_pb2.EndedRetention) -> None:
        """The registry serves ``ended`` again after confirming its end: etcd went back in time (its
        revision may be past all this sidecar saw: others wrote since). Registered again, with it."""
        log.error(
            "the registry serves a retention this engine ended (etcd restored from an older snapshot?); "
            "registering again",
            extra={
                "engine_id": self.identity.engine_id,
                "engine_request_id": ended.engine_request_id,
                "end_revision": ended.end_revision,
            },
        )
        self._ended_evidence = ended
        self._wake.set()

    async def wait_registered(self) -> int:
        """Waits until the engine is registered; returns that registration's generation."""
        while True:
            pulse = self._pulse
            if self.phase is Phase.REGISTERED:
                return self.generation
            await pulse.wait()

    async def wait_lapsed(self, generation: int) -> None:
        """Returns once registration ``generation`` is no longer the live one."""
        while True:
            pulse = self._pulse
            if self.phase is not Phase.REGISTERED or self.generation != generation:
                return
            await pulse.wait()

    # ---- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            self._set_phase(Phase.WAITING_FOR_ENGINE)
            await self._monitor.wait_up()
            facts = await self._read_facts()
            if facts is None:
                continue
            engine = describe_engine(self.identity, facts, self.release_grace_seconds)
            self._set_phase(Phase.REGISTERING)
            if not await self._register(engine):
                continue
            outcome = await self._heartbeat_until_lost()
            if outcome is _Outcome.ENGINE_DOWN:
                log.warning("engine is down: deregistering it", extra={"engine_id": self.identity.engine_id})
                self._set_phase(Phase.WAITING_FOR_ENGINE)
                await self._deregister()
                # The engine that comes back may run with other settings: its connector says them again.
                self.release_grace_seconds = 0.0

    async def shutdown(self) -> bool:
        """Deregisters the engine (clean shutdown); True if the registry confirmed it."""
        self._set_phase(Phase.STOPPED)
        self._wake.set()
        return await self._deregister()

    async def _read_facts(self) -> EngineFacts | None:
        backoff = Backoff(self._settings.backoff)
        while self._monitor.state is not EngineState.DOWN:
            try:
                return await self._probe.read_facts()
            except EngineProbeError as err:
                log.warning("engine is healthy but its facts are unreadable", extra={"error": str(err)})
            await self._clock.sleep(backoff.next_delay())
        return None

    async def _register(self, engine: resources_pb2.Engine) -> bool:
        backoff = Backoff(self._settings.backoff)
        while self._monitor.state is not EngineState.DOWN and self.phase is not Phase.STOPPED:
            try:
                response = await self._registry.register_engine(
                    engine,
                    self._settings.ttl_seconds,
                    seen_revision=self._rewind_evidence,
                    seen_epoch=self.epoch,
                    ended=self._ended_evidence,
                )
            except RegistryError as err:
                if err.kind in _REJECTING_KINDS:
                    raise RegistrationRejected(
                        f"the registry refused engine {engine.engine_id!r}: {err.kind.name}: {err.message}"
                    ) from err
                self._link(False, "registration failed; retrying", err)
                await self._clock.wait(self._wake, backoff.next_delay())
                self._wake.clear()
                continue
            self.engine = response.engine if response.HasField("engine") else engine
            # The connector may have said (another) grace while the registration was under way.
            self._grace_unpublished = self.release_grace_seconds != engine.release_grace_seconds
            self.granted_ttl_seconds = int(response.ttl_seconds or self._settings.ttl_seconds or 1)
            self.incarnation = response.incarnation
            self.epoch = response.epoch
            self._rewind_evidence = 0
            self._ended_evidence = None
            is_first = self.generation == 0
            self.generation += 1
            self._metrics.registrations.inc()
            if not is_first:
                self._metrics.reregistrations.inc()
            self._heartbeat_ok()
            log.info(
                "engine registered",
                extra={
                    "engine_id": engine.engine_id,
                    "generation": self.generation,
                    "ttl_seconds": self.granted_ttl_seconds,
                    "model": engine.model,
                    "block_size": engine.block_size,
                    "kv_capacity_blocks": engine.kv_capacity_blocks,
                    "release_grace_seconds": engine.release_grace_seconds,
                },
            )
            self._set_phase(Phase.REGISTERED)
            if self._grace_unpublished:
                self._wake.set()
            return True
        return False

    async def _heartbeat_until_lost(self) -> _Outcome:
        backoff = Backoff(self._settings.backoff)
        delay = self.heartbeat_interval_seconds
        while True:
            await self._clock.wait(self._wake, delay)
            self._wake.clear()
            if self.phase is Phase.STOPPED or self._monitor.state is EngineState.DOWN:
                return _Outcome.ENGINE_DOWN
            if self._rewind_evidence:
                return self._lost(
                    f"etcd went back in time (this sidecar saw revision {self._rewind_evidence})"
                )
            if self._ended_evidence is not None:
                return self._lost(
                    f"etcd went back in time (the registry serves {self._ended_evidence.engine_request_id}, "
                    "which this engine ended)"
                )
            grace = self.release_grace_seconds if self._grace_unpublished else 0.0
            try:
                stats = self._stats
                await self._registry.heartbeat_engine(
                    self.identity.engine_id, stats, self.incarnation, release_grace_seconds=grace
                )
                self._stats_sent = stats
            except RegistryError as err:
                if err.kind is ErrorKind.NOT_FOUND:
                    return self._lost(err.message)
                self._metrics.heartbeat_failures.inc()
                self._link(False, "heartbeat failed; retrying", err)
                # Retry sooner than the interval, never later: the lease is running out.
                delay = min(backoff.next_delay(), self.heartbeat_interval_seconds)
                continue
            self._metrics.heartbeat()
            self._heartbeat_ok()
            if grace and grace == self.release_grace_seconds:
                self._grace_unpublished = False
                if self.engine is not None:
                    self.engine.release_grace_seconds = grace
            backoff.reset()
            delay = self.heartbeat_interval_seconds

    def _lost(self, why: str) -> _Outcome:
        log.warning(
            "engine lease lost; re-registering", extra={"engine_id": self.identity.engine_id, "why": why}
        )
        self._link(False)
        self._set_phase(Phase.REGISTERING)
        return _Outcome.LEASE_LOST

    async def _deregister(self) -> bool:
        try:
            await self._registry.deregister_engine(self.identity.engine_id)
        except RegistryError as err:
            if err.kind is not ErrorKind.NOT_FOUND:
                log.warning(
                    "deregistration failed; the engine's lease will expire on its own",
                    extra={"engine_id": self.identity.engine_id, "error": str(err)},
                )
                self._link(False)
                return False
        log.info("engine deregistered", extra={"engine_id": self.identity.engine_id})
        self._link(False)
        self._on_deregistered()
        return True

    def _heartbeat_ok(self) -> None:
        self.last_heartbeat_time = self._clock.time()
        self._metrics.last_heartbeat.set(self.last_heartbeat_time)
        self._link(True)

    def _link(self, up: bool, message: str | None = None, err: RegistryError | None = None) -> None:
        # One warning per outage, not one per retry.
        if not up and message is not None and not self._outage_logged:
            log.warning(message, extra={"engine_id": self.identity.engine_id, "error": str(err)})
            self._outage_logged = True
        if up and self._outage_logged:
            log.info("registry link restored", extra={"engine_id": self.identity.engine_id})
            self._outage_logged = False
        if up == self.link_up:
            return
        self.link_up = up
        self._metrics.registry_up.set(1 if up else 0)
        self._notify()

    def _set_phase(self, phase: Phase) -> None:
        if phase is self.phase:
            return
        if self.phase is Phase.STOPPED:
            return
        self.phase = phase
        self._notify()

    def _notify(self) -> None:
        pulse, self._pulse = self._pulse, asyncio.Event()
        pulse.set()
        self._on_change()


def _decision_rates(
    stats: resources_pb2.EngineStats | None,
) -> tuple[float, tuple[tuple[str, int, float], ...]]:
    """The rates the router's pull-or-recompute choice reads."""
    if stats is None:
        return 0.0, ()
    peers = tuple((p.peer_engine_id, p.tier, p.bytes_per_second) for p in stats.peer_pull_rates)
    return stats.prefill_tokens_per_second, peers
