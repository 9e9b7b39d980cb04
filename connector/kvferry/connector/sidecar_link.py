"""The connector's link to its local sidecar, run on a background thread so the scheduler loop
never waits on the network.

One daemon thread hosts an asyncio loop with four tasks:

- sender: ReportRetention / EndRetention calls, one at a time. What to send is not queued here but
  asked of the listener (the retention table) each time (:meth:`ReleaseListener.take_call`), so no
  call is ever dropped or sent for a retention that no longer needs it; the scheduler thread only
  pokes the sender (:meth:`SidecarLink.poke`).
- watcher: the WatchReleases stream (SYNC, RENEWED, ENDED), fed to a :class:`ReleaseListener`;
  reconnects with backoff. Each watch says the engine's release grace, which the sidecar publishes.
- stats: ReportEngineStats every ``stats_interval_seconds`` while the stats change, and at once when a
  rate the router decides on moved (:func:`~kvferry.connector.accounting.rates_moved`): the router's
  next turn should already follow a pull that turned out slow.
- timer: wakes the engine when the next retained block is due to be freed, so frees happen on
  time even when no request runs (the engine's loop sleeps otherwise).

Losing the sidecar is logged once per outage, never per request; meanwhile retentions fall back
to the connector's hard cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from kvferry.connector.accounting import StatsSnapshot, rates_moved
from kvferry.connector.retention import EndReason, Tier
from kvferry.v1 import resources_pb2, sidecar_service_pb2, sidecar_service_pb2_grpc

logger = logging.getLogger("kvferry.connector.sidecar_link")

_REASONS = {
    resources_pb2.RELEASE_REASON_EXPIRED: EndReason.EXPIRED,
    resources_pb2.RELEASE_REASON_RELEASED: EndReason.RELEASED,
    resources_pb2.RELEASE_REASON_SUPERSEDED: EndReason.SUPERSEDED,
    resources_pb2.RELEASE_REASON_ENGINE_GONE: EndReason.ENGINE_GONE,
    resources_pb2.RELEASE_REASON_EVICTED: EndReason.EVICTED,
}
# Calls that fail with these codes are retried once the sidecar is back; others are dropped.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# The sender looks for calls at least this often (an end refused is asked again after a while).
_IDLE_RECHECK_SECONDS = 5.0
# The sidecar is the engine's neighbour: after it restarts, relink within about a second (gRPC's own
# reconnect backoff grows to 120 s, and until the watch is back the sidecar lacks the release grace and
# no retention is published).
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 1000)]
_MAX_RETRY_SECONDS = 1.0
# The reason an EndRetention gives the registry, from why the connector ends the retention.
_END_REASONS = {
    EndReason.EVICTED: resources_pb2.RELEASE_REASON_EVICTED,
    EndReason.HARD_CAP: resources_pb2.RELEASE_REASON_HARD_CAP,
    EndReason.SUPERSEDED: resources_pb2.RELEASE_REASON_SUPERSEDED,
    EndReason.REFUSED: resources_pb2.RELEASE_REASON_SUPERSEDED,
}

_MEMORY_TIERS = {Tier.DEVICE: resources_pb2.MEMORY_TIER_DEVICE, Tier.HOST: resources_pb2.MEMORY_TIER_HOST}


@dataclass(frozen=True)
class RetentionReport:
    tenant: str
    conversation_id: str
    engine_id: str
    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    block_digests: tuple[bytes, ...]
    turn: int
    ttl_seconds: int
    # One per block id (empty: the engine does not fence pulls).
    block_generations: tuple[int, ...] = ()
    tier: Tier = Tier.DEVICE
    # A relocation to another tier: the request id of the record it replaces.
    relocates: str = ""

    def to_proto(self) -> resources_pb2.Retention:
        return resources_pb2.Retention(
            tenant=self.tenant,
            conversation_id=self.conversation_id,
            engine_id=self.engine_id,
            engine_request_id=self.request_id,
            block_ids=list(self.block_ids),
            num_tokens=self.num_tokens,
            block_digests=list(self.block_digests),
            turn=self.turn,
            ttl_seconds=self.ttl_seconds,
            block_generations=list(self.block_generations),
            tier=_MEMORY_TIERS[self.tier],
            relocates_engine_request_id=self.relocates,
        )


@dataclass(frozen=True)
class EndCall:
    """An end the engine started, for the registry to confirm (EndRetention)."""

    tenant: str
    conversation_id: str
    request_id: str
    reason: EndReason

    def to_proto(self) -> sidecar_service_pb2.EndRetentionRequest:
        return sidecar_service_pb2.EndRetentionRequest(
            tenant=self.tenant,
            conversation_id=self.conversation_id,
            engine_request_id=self.request_id,
            reason=_END_REASONS.get(self.reason, resources_pb2.RELEASE_REASON_RELEASED),
        )


class ReleaseListener(Protocol):
    """What the link asks for and reports back (called on the link's thread)."""

    def take_call(self) -> RetentionReport | EndCall | None:
        """The next call to make; a report taken is in flight until one of its outcomes is given."""
        ...

    def on_acknowledged(
        self, report: RetentionReport, lease_expire_wall: float | None, revision: int
    ) -> None: ...

    def on_report_refused(self, report: RetentionReport, code: grpc.StatusCode, details: str) -> None: ...

    def on_report_failed(self, report: RetentionReport) -> None:
        """No answer (the link failed): the report may have landed all the same."""
        ...

    def on_end_confirmed(self, call: EndCall, ended: bool, revision: int) -> None: ...

    def on_end_refused(self, call: EndCall, code: grpc.StatusCode, details: str) -> None: ...

    def on_sync(self, live_request_ids: list[str], revision: int) -> None: ...

    def on_renewed(self, request_id: str, lease_expire_wall: float | None, revision: int) -> None: ...

    def on_ended(self, request_id: str, reason: EndReason, revision: int) -> None: ...


class BackgroundLoop:
    """A daemon thread running one asyncio loop."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, callback: Callable[[], Any]) -> None:
        self.loop.call_soon_threadsafe(callback)

    def stop(self, timeout: float = 5.0) -> None:
        if not self._started:
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        future = asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop)
        try:
            future.result(timeout)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)


class DueTimer:
    """Calls ``wake`` when ``next_due()`` (a monotonic time) arrives; :meth:`poke` after changes."""

    # After waking, wait at least this long before waking again for the same deadline (the
    # engine needs a moment to step); bounds the cost if a wake-up is lost.
    _REWAKE_SECONDS = 0.25

    def __init__(
        self, loop: BackgroundLoop, next_due: Callable[[], float | None], wake: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._next_due = next_due
        self._wake = wake
        self._changed: asyncio.Event | None = None

    def start(self) -> None:
        self._loop.submit(self._run())

    def poke(self) -> None:
        self._loop.call_soon(self._set_changed)

    def _set_changed(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _run(self) -> None:
        self._changed = asyncio.Event()
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            due = self._next_due()
            timeout: float | None = None
            if due is not None:
                # next_due is time.monotonic(); the loop's clock is monotonic too.
                delay = due - loop.time()
                if delay <= 0:
                    try:
                        self._wake()
                    except Exception:
                        logger.exception("waking the engine failed")
                    timeout = self._REWAKE_SECONDS
                else:
                    timeout = delay
            # asyncio.timeout, not wait_for: on Python 3.11 a wait_for cancelled just after its event was set
            # returns instead of raising, and this loop would outlive its cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()


class SidecarLink:
    """Client side of the local SidecarService (runs on a :class:`BackgroundLoop`)."""

    def __init__(
        self,
        *,
        loop: BackgroundLoop,
        address: str,
        engine_id: str,
        listener: ReleaseListener,
        stats: Callable[[], tuple[int, StatsSnapshot]],
        timeout_seconds: float,
        stats_interval_seconds: float,
        release_grace_seconds: float = 0.0,
    ) -> None:
        self._loop = loop
        self.address = address
        self.engine_id = engine_id
        # Said on every watch: the sidecar publishes it in the engine's registry record.
        self.release_grace_seconds = release_grace_seconds
        self._listener = listener
        self._stats = stats
        self._timeout = timeout_seconds
        self._stats_interval = stats_interval_seconds
        self._wakeup: asyncio.Event | None = None
        self._measured: asyncio.Event | None = None
        self._connected: asyncio.Event | None = None
        self._link_up: bool | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: sidecar_service_pb2_grpc.SidecarServiceStub | None = None

    # -- called from the scheduler thread -------------------------------------------------------

    def start(self) -> None:
        self._loop.submit(self._main())

    def poke(self) -> None:
        """Something may need sending (a retention to report, an end to confirm)."""
        self._loop.call_soon(self._wake_sender)

    def rates_measured(self) -> None:
        """A new pull or prefill sample: report the rates now if they moved."""
        self._loop.call_soon(self._wake_stats)

    @property
    def connected(self) -> bool:
        return bool(self._link_up)

    # -- on the link's loop ---------------------------------------------------------------------

    def _wake_sender(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _wake_stats(self) -> None:
        if self._measured is not None:
            self._measured.set()

    async def _main(self) -> None:
        self._wakeup = asyncio.Event()
        self._measured = asyncio.Event()
        self._connected = asyncio.Event()
        self._channel = grpc.aio.insecure_channel(self.address, options=_CHANNEL_OPTIONS)
        self._stub = sidecar_service_pb2_grpc.SidecarServiceStub(self._channel)
        try:
            await asyncio.gather(self._watch(), self._send(), self._send_stats())
        finally:
            await self._channel.close(grace=None)

    def _set_link(self, up: bool, error: BaseException | None = None) -> None:
        assert self._connected is not None
        if up:
            self._connected.set()
        else:
            self._connected.clear()
        if up == self._link_up:
            return
        first = self._link_up is None
        self._link_up = up
        if up:
            logger.info("sidecar link up", extra={"sidecar": self.address, "engine_id": self.engine_id})
        elif first:
            logger.warning(
                "sidecar not reachable; retentions fall back to the hard cap until it answers",
                extra={"sidecar": self.address, "error": _describe(error)},
            )
        else:
            logger.warning(
                "sidecar link lost; retentions fall back to the hard cap, reconnecting",
                extra={"sidecar": self.address, "error": _describe(error)},
            )

    async def _watch(self) -> None:
        assert self._stub is not None
        backoff = 0.5
        request = sidecar_service_pb2.WatchReleasesRequest(
            engine_id=self.engine_id, release_grace_seconds=self.release_grace_seconds
        )
        while True:
            try:
                call = self._stub.WatchReleases(request)
                async for event in call:
                    if not self.connected:
                        self._set_link(True)
                        backoff = 0.5
                        self._wake_sender()  # what waited for the link goes out now
                    self._dispatch(event)
                self._set_link(False, ConnectionError("WatchReleases stream ended"))
            except grpc.aio.AioRpcError as error:
                self._set_link(False, error)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.exception("sidecar watch failed")
                self._set_link(False, error)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_RETRY_SECONDS)

    def _dispatch(self, event: sidecar_service_pb2.WatchReleasesResponse) -> None:
        kind = event.type
        if kind == sidecar_service_pb2.RELEASE_EVENT_TYPE_SYNC:
            self._listener.on_sync(list(event.live_engine_request_ids), event.revision)
        elif kind == sidecar_service_pb2.RELEASE_EVENT_TYPE_RENEWED:
            expire = event.expire_time.ToNanoseconds() / 1e9 if event.HasField("expire_time") else None
            self._listener.on_renewed(event.engine_request_id, expire, event.revision)
        elif kind == sidecar_service_pb2.RELEASE_EVENT_TYPE_ENDED:
            reason = _REASONS.get(event.reason, EndReason.RELEASED)
            self._listener.on_ended(event.engine_request_id, reason, event.revision)
        else:
            logger.warning("unknown release event type", extra={"type": int(kind)})

    async def _send(self) -> None:
        assert self._stub is not None and self._wakeup is not None
        backoff = 0.5
        while True:
            # Cleared before asking, so a poke that comes meanwhile is not lost.
            self._wakeup.clear()
            call = self._listener.take_call()
            if call is None:
                # Woken by a poke; now and then regardless, for calls asked to wait a while.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_IDLE_RECHECK_SECONDS):
                        await self._wakeup.wait()
                continue
            try:
                await self._make(call)
                backoff = 0.5
            except grpc.aio.AioRpcError as error:
                code = error.code()
                if code in _RETRYABLE:
                    if isinstance(call, RetentionReport):
                        self._listener.on_report_failed(call)
                    self._set_link(False, error)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_RETRY_SECONDS)
                    continue
                details = error.details() or ""
                if isinstance(call, RetentionReport):
                    self._listener.on_report_refused(call, code, details)
                else:
                    self._listener.on_end_refused(call, code, details)
            except Exception:
                # A bug must not stop the sender: the call is asked for again after a pause.
                logger.exception("sidecar call failed", extra={"call": type(call).__name__})
                if isinstance(call, RetentionReport):
                    self._listener.on_report_failed(call)
                await asyncio.sleep(backoff)

    async def _make(self, call: RetentionReport | EndCall) -> None:
        assert self._stub is not None
        if isinstance(call, RetentionReport):
            response = await self._stub.ReportRetention(
                sidecar_service_pb2.ReportRetentionRequest(retention=call.to_proto()), timeout=self._timeout
            )
            retention = response.retention
            expire = (
                retention.expire_time.ToNanoseconds() / 1e9 if retention.HasField("expire_time") else None
            )
            self._listener.on_acknowledged(call, expire, response.revision)
        else:
            ended = await self._stub.EndRetention(call.to_proto(), timeout=self._timeout)
            self._listener.on_end_confirmed(call, ended.ended, ended.revision)

    async def _send_stats(self) -> None:
        assert self._stub is not None and self._connected is not None and self._measured is not None
        sent_version = -1
        sent: StatsSnapshot | None = None
        idle_rounds = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._stats_interval):
                    await self._measured.wait()
            early = self._measured.is_set()
            self._measured.clear()
            if not self.connected:
                continue
            version, snapshot = self._stats()
            if early:
                if not rates_moved(sent, snapshot):
                    continue
            else:
                idle_rounds += 1
                # Unchanged stats still go out now and then, so the sidecar sees the engine is alive.
                if version == sent_version and idle_rounds < 12:
                    continue
            try:
                await self._stub.ReportEngineStats(
                    sidecar_service_pb2.ReportEngineStatsRequest(stats=stats_to_proto(snapshot)),
                    timeout=self._timeout,
                )
                sent_version = version
                sent = snapshot
                idle_rounds = 0
            except grpc.aio.AioRpcError as error:
                if error.code() in _RETRYABLE:
                    self._set_link(False, error)


def stats_to_proto(snapshot: StatsSnapshot) -> resources_pb2.EngineStats:
    return resources_pb2.EngineStats(
        prefill_tokens_per_second=snapshot.prefill_tokens_per_second,
        transfer_bytes_per_second=snapshot.transfer_bytes_per_second,
        kv_bytes_per_token=snapshot.kv_bytes_per_token,
        inflight_prefill_tokens=snapshot.inflight_prefill_tokens,
        running_requests=snapshot.running_requests,
        retained_blocks=snapshot.retained_blocks,
        pulled_tokens_total=snapshot.pulled_tokens_total,
        computed_tokens_total=snapshot.computed_tokens_total,
        fenced_pulls_total=snapshot.fenced_pulls_total,
        peer_pull_rates=[
            resources_pb2.PeerPullRate(
                peer_engine_id=p.peer_engine_id,
                bytes_per_second=p.bytes_per_second,
                pulls=p.pulls,
                tier=_MEMORY_TIERS[p.tier],
            )
            for p in snapshot.peer_pull_rates
        ],
    )


def _describe(error: BaseException | None) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return repr(error) if error is not None else ""
