"""The connector's sidecar link against a STAND-IN SidecarService (a gRPC server in the test).

The stand-in records calls and scripts WatchReleases events; the same link runs against the real
sidecar and registry in test_ends.py, and with real engines in the sidecar's own tests. Covered
here: reports, ends and their answers, refusals reaching the listener, release events with their
revisions, calls waiting across a sidecar outage, and the due-timer's wake-ups.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from kvferry.connector.accounting import Accounting, StatsSnapshot
from kvferry.connector.retention import EndReason
from kvferry.connector.sidecar_link import BackgroundLoop, DueTimer, EndCall, RetentionReport, SidecarLink
from kvferry.stack.etcd_process import free_port
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as pb
from kvferry.v1 import sidecar_service_pb2_grpc as pb_grpc

from tests.fixtures.polling import eventually


class StandInSidecar(pb_grpc.SidecarServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.reports: list[Any] = []
        self.ends: list[Any] = []
        self.stats: list[Any] = []
        self.events: asyncio.Queue[pb.WatchReleasesResponse] = asyncio.Queue()
        self.watchers = 0
        # Request ids whose report is refused (as the registry refuses a turn that is not newer).
        self.refuse: set[str] = set()

    async def ReportRetention(self, request: Any, context: Any) -> Any:
        self.reports.append(request.retention)
        if request.retention.engine_request_id in self.refuse:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "turn 2 is not newer")
        retention = pb.ReportRetentionResponse(retention=request.retention).retention
        retention.expire_time.FromSeconds(int(time.time()) + 600)
        return pb.ReportRetentionResponse(retention=retention, revision=40 + len(self.reports))

    async def EvictRetention(self, request: Any, context: Any) -> Any:
        raise AssertionError("the connector ends retentions with EndRetention")

    async def EndRetention(self, request: Any, context: Any) -> Any:
        self.ends.append(request)
        return pb.EndRetentionResponse(ended=True, revision=90 + len(self.ends))

    async def ReportEngineStats(self, request: Any, context: Any) -> Any:
        self.stats.append(request.stats)
        return pb.ReportEngineStatsResponse()

    async def WatchReleases(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.watchers += 1
        yield pb.WatchReleasesResponse(
            type=pb.RELEASE_EVENT_TYPE_SYNC, live_engine_request_ids=["r-live"], revision=33
        )
        while True:
            yield await self.events.get()


class Listener:
    """Records what the link reports; hands out the calls in ``calls_to_make`` until each settles."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.calls_to_make: list[RetentionReport | EndCall] = []

    def take_call(self) -> RetentionReport | EndCall | None:
        return self.calls_to_make[0] if self.calls_to_make else None

    def _settled(self, call: RetentionReport | EndCall) -> None:
        self.calls_to_make.remove(call)

    def on_acknowledged(
        self, report: RetentionReport, lease_expire_wall: float | None, revision: int
    ) -> None:
        self._settled(report)
        self.calls.append(("ack", (report.request_id, lease_expire_wall, revision)))

    def on_report_refused(self, report: RetentionReport, code: grpc.StatusCode, details: str) -> None:
        self._settled(report)
        self.calls.append(("refused", (report.request_id, code)))

    def on_report_failed(self, report: RetentionReport) -> None:
        self.calls.append(("failed", report.request_id))

    def on_end_confirmed(self, call: EndCall, ended: bool, revision: int) -> None:
        self._settled(call)
        self.calls.append(("end_confirmed", (call.request_id, ended, revision)))

    def on_end_refused(self, call: EndCall, code: grpc.StatusCode, details: str) -> None:
        self._settled(call)
        self.calls.append(("end_refused", (call.request_id, code)))

    def on_sync(self, live_request_ids: list[str], revision: int) -> None:
        self.calls.append(("sync", (live_request_ids, revision)))

    def on_renewed(self, request_id: str, lease_expire_wall: float | None, revision: int) -> None:
        self.calls.append(("renewed", (request_id, lease_expire_wall, revision)))

    def on_ended(self, request_id: str, reason: EndReason, revision: int) -> None:
        self.calls.append(("ended", (request_id, reason, revision)))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]


async def _serve(sidecar: StandInSidecar, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_SidecarServiceServicer_to_server(sidecar, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


REPORT = RetentionReport(
    tenant="acme", conversation_id="c1", engine_id="decode-0", request_id="r1", block_ids=(1, 2),
    num_tokens=40, block_digests=(b"\x01" * 16,), turn=2, ttl_seconds=30,
)  # fmt: skip


@pytest.fixture
def link_parts() -> Any:
    loop = BackgroundLoop("test-link")
    listener = Listener()
    accounting = Accounting(kv_bytes_per_token=4096)

    def stats() -> tuple[int, StatsSnapshot]:
        return accounting.version, accounting.snapshot()

    port = free_port()
    link = SidecarLink(
        loop=loop, address=f"127.0.0.1:{port}", engine_id="decode-0", listener=listener, stats=stats,
        timeout_seconds=1.0, stats_interval_seconds=0.2,
    )  # fmt: skip
    yield loop, link, listener, port, accounting
    loop.stop()


async def test_reports_ends_events_and_stats_flow_both_ways(link_parts: Any) -> None:
    loop, link, listener, port, accounting = link_parts
    sidecar = StandInSidecar()
    server = await _serve(sidecar, port)
    try:
        loop.start()
        link.start()
        await eventually(lambda: link.connected and "sync" in listener.kinds())
        assert listener.calls[0] == ("sync", (["r-live"], 33))
        listener.calls_to_make += [REPORT, EndCall("acme", "c0", "r0", EndReason.EVICTED)]
        link.poke()
        await eventually(lambda: "ack" in listener.kinds() and "end_confirmed" in listener.kinds())
        (sent,) = sidecar.reports
        assert (sent.engine_request_id, list(sent.block_ids), sent.turn, sent.ttl_seconds) == (
            "r1",
            [1, 2],
            2,
            30,
        )
        assert list(sent.block_digests) == [b"\x01" * 16]
        calls = dict(listener.calls)
        assert calls["ack"][0] == "r1" and calls["ack"][1] > time.time() + 500 and calls["ack"][2] == 41
        (end,) = sidecar.ends
        assert (end.engine_request_id, end.reason) == ("r0", resources_pb2.RELEASE_REASON_EVICTED)
        assert calls["end_confirmed"] == ("r0", True, 91)

        expire = Timestamp()
        expire.FromSeconds(int(time.time()) + 900)
        await sidecar.events.put(
            pb.WatchReleasesResponse(
                type=pb.RELEASE_EVENT_TYPE_RENEWED, engine_request_id="r1", expire_time=expire, revision=50
            )
        )
        await sidecar.events.put(
            pb.WatchReleasesResponse(
                type=pb.RELEASE_EVENT_TYPE_ENDED,
                engine_request_id="r1",
                reason=resources_pb2.RELEASE_REASON_SUPERSEDED,
                revision=51,
            )
        )
        await eventually(lambda: "ended" in listener.kinds())
        calls = dict(listener.calls)
        assert calls["renewed"] == ("r1", float(expire.seconds), 50)
        assert calls["ended"] == ("r1", EndReason.SUPERSEDED, 51)

        accounting.set_retained_blocks(2)
        await eventually(lambda: any(s.retained_blocks == 2 for s in sidecar.stats))
    finally:
        await server.stop(None)


async def test_a_refused_report_reaches_the_listener(link_parts: Any) -> None:
    """The registry refuses a second publish of a turn: the connector must hear it, not drop it."""
    loop, link, listener, port, _ = link_parts
    sidecar = StandInSidecar()
    sidecar.refuse.add("r1")
    server = await _serve(sidecar, port)
    try:
        loop.start()
        link.start()
        listener.calls_to_make.append(REPORT)
        link.poke()
        await eventually(lambda: "refused" in listener.kinds())
        assert dict(listener.calls)["refused"] == ("r1", grpc.StatusCode.FAILED_PRECONDITION)
        assert len(sidecar.reports) == 1
    finally:
        await server.stop(None)


async def test_calls_waiting_while_the_sidecar_is_away_go_out_when_it_returns(link_parts: Any) -> None:
    loop, link, listener, port, _ = link_parts
    listener.calls_to_make += [REPORT, EndCall("acme", "c9", "r9", EndReason.HARD_CAP)]
    loop.start()
    link.start()
    await eventually(lambda: "failed" in listener.kinds(), within=5.0)
    assert not link.connected
    sidecar = StandInSidecar()
    server = await _serve(sidecar, port)
    try:
        # The link reconnects by itself (backoff <= 10 s); nothing was dropped meanwhile.
        await eventually(lambda: bool(sidecar.reports) and bool(sidecar.ends), within=20.0)
        assert sidecar.reports[0].engine_request_id == "r1"
        assert (sidecar.ends[0].engine_request_id, sidecar.ends[0].reason) == (
            "r9",
            resources_pb2.RELEASE_REASON_HARD_CAP,
        )
        # Settled once their answers are back (the stand-in records a call before it answers).
        await eventually(lambda: listener.calls_to_make == [], within=5.0)
    finally:
        await server.stop(None)


async def test_due_timer_wakes_at_the_deadline_and_after_changes() -> None:
    loop = BackgroundLoop("test-timer")
    wakes: list[float] = []
    due: list[float | None] = [None]
    timer = DueTimer(loop, lambda: due[0], lambda: wakes.append(time.monotonic()))
    timer.start()
    loop.start()
    try:
        await asyncio.sleep(0.3)
        assert wakes == []
        target = time.monotonic() + 0.5
        due[0] = target
        timer.poke()
        await eventually(lambda: bool(wakes), within=3.0)
        assert wakes[0] >= target - 0.01
        due[0] = None
        timer.poke()
        await asyncio.sleep(0.6)
        settled = len(wakes)
        await asyncio.sleep(0.6)
        assert len(wakes) == settled, "no wake-ups once nothing is due"
    finally:
        loop.stop()
