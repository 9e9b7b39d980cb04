"""Watching the vLLM engine the sidecar stands beside: is it up, and what does it say about itself."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvferry.pd.engine_api import ENGINE_ERRORS, EngineUnavailableError
from kvferry.pd.engine_client import HttpTimeouts, VllmEngineClient
from kvferry.pd.engine_metrics import samples
from kvferry.runtime.clock import Clock

log = logging.getLogger("kvferry.sidecar.engine")

# vLLM exports its CacheConfig as labels of this gauge on /metrics.
_CACHE_CONFIG_METRIC = "vllm:cache_config_info"


class ProbeResult(enum.Enum):
    """One health probe's outcome."""

    # /health answered 200.
    OK = "ok"
    # Answered with an error status or too slowly: maybe busy, maybe dying.
    FAILING = "failing"
    # Nothing listens: the engine process is gone (or restarting, which loses its KV anyway).
    UNREACHABLE = "unreachable"


class EngineState(enum.Enum):
    UNKNOWN = "unknown"
    UP = "up"
    # Probes fail, but not yet for long enough to give the engine up.
    DEGRADED = "degraded"
    DOWN = "down"


@dataclass(frozen=True)
class EngineFacts:
    """What the engine says about itself; None where it did not say."""

    model: str | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    kv_capacity_blocks: int | None = None


class EngineProbeError(Exception):
    """The engine could not be asked (or gave an answer that makes no sense)."""


class EngineProbe(Protocol):
    async def check_health(self) -> ProbeResult: ...

    async def read_facts(self) -> EngineFacts: ...


class HttpEngineProbe:
    """Probes vLLM's OpenAI server through the engine client: ``/health``, ``/v1/models`` and ``/metrics``."""

    def __init__(self, base_url: str, *, timeout_seconds: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        timeouts = HttpTimeouts(connect=timeout_seconds, pool=timeout_seconds, control=timeout_seconds)
        # The probe asks nothing of a model: the client's model is never sent.
        self._client = VllmEngineClient(self.base_url, model="", timeouts=timeouts, max_connections=2)

    async def close(self) -> None:
        await self._client.aclose()

    async def check_health(self) -> ProbeResult:
        try:
            status = await self._client.health_status()
        except EngineUnavailableError as error:
            return ProbeResult.UNREACHABLE if error.refused else ProbeResult.FAILING
        return ProbeResult.OK if status == 200 else ProbeResult.FAILING

    async def read_facts(self) -> EngineFacts:
        try:
            models = await self._client.models()
        except (*ENGINE_ERRORS, KeyError, TypeError, ValueError) as err:
            raise EngineProbeError(f"GET {self.base_url}/v1/models failed: {err!r}") from err
        if not models:
            raise EngineProbeError(f"{self.base_url}/v1/models gave no model")
        block_size, capacity = None, None
        try:
            block_size, capacity = _cache_facts(await self._client.metrics_text())
        except (*ENGINE_ERRORS, ValueError) as err:
            # Flags can supply these; /v1/models is what we cannot do without.
            log.info("engine /metrics unreadable", extra={"error": repr(err)})
        return EngineFacts(
            model=models[0].id,
            max_model_len=models[0].max_model_len,
            block_size=block_size,
            kv_capacity_blocks=capacity,
        )


def _cache_facts(metrics_text: str) -> tuple[int | None, int | None]:
    for sample in samples(metrics_text):
        if sample.name == _CACHE_CONFIG_METRIC:
            return _as_int(sample.labels.get("block_size")), _as_int(sample.labels.get("num_gpu_blocks"))
    return None, None


def _as_int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class EngineMonitorSettings:
    # Seconds between /health probes.
    probe_interval_seconds: float = 2.0
    # Failing probes (errors, timeouts) for this long mark the engine DOWN. A refused
    # connection marks it DOWN at once: the process is gone and its KV with it.
    down_after_seconds: float = 30.0


class EngineMonitor:
    """Probes the engine on a fixed interval and keeps its state; wakes waiters on changes."""

    def __init__(
        self,
        probe: EngineProbe,
        clock: Clock,
        settings: EngineMonitorSettings,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self._probe = probe
        self._clock = clock
        self._settings = settings
        self._on_change = on_change
        self.state = EngineState.UNKNOWN
        self.last_ok_time: float | None = None
        self._failing_since: float | None = None
        self._up = asyncio.Event()
        self._down = asyncio.Event()

    @property
    def reachable(self) -> bool:
        return self.state is EngineState.UP

    async def wait_up(self) -> None:
        await self._up.wait()

    @property
    def down_event(self) -> asyncio.Event:
        """Set while the engine is DOWN."""
        return self._down

    async def run(self) -> None:
        while True:
            await self.probe_once()
            await self._clock.sleep(self._settings.probe_interval_seconds)

    async def probe_once(self) -> EngineState:
        result = await self._probe.check_health()
        now = self._clock.monotonic()
        if result is ProbeResult.OK:
            self._failing_since = None
            self.last_ok_time = self._clock.time()
            self._set(EngineState.UP, result)
        elif result is ProbeResult.UNREACHABLE:
            self._failing_since = self._failing_since or now
            self._set(EngineState.DOWN, result)
        else:
            self._failing_since = self._failing_since or now
            given_up = now - self._failing_since >= self._settings.down_after_seconds
            if given_up or self.state in (EngineState.UNKNOWN, EngineState.DOWN):
                self._set(EngineState.DOWN, result)
            else:
                self._set(EngineState.DEGRADED, result)
        return self.state

    def _set(self, state: EngineState, result: ProbeResult) -> None:
        if state is self.state:
            return
        previous, self.state = self.state, state
        log_level = logging.INFO if state is EngineState.UP else logging.WARNING
        log.log(
            log_level,
            "engine state changed",
            extra={"from": previous.value, "to": state.value, "probe": result.value},
        )
        if state is EngineState.DOWN:
            self._up.clear()
            self._down.set()
        elif state is EngineState.UP:
            self._down.clear()
            self._up.set()
        self._on_change()
