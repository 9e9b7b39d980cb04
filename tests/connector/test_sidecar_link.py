"""The connector's sidecar link against a STAND-IN SidecarService (a gRPC server in the test).

The stand-in records calls and scripts WatchReleases events; the real sidecar is exercised with
real engines in the sidecar's own tests. Covered here: reports and their acknowledgement, release
events reaching the listener, retries across a sidecar outage, and the due-timer's wake-ups.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from kvferry.common.etcd_process import free_port
from kvferry.connector.accounting import Accounting, StatsSnapshot
from kvferry.connector.retention import EndReason
from kvferry.connector.sidecar_link import BackgroundLoop, DueTimer, Eviction, RetentionReport, SidecarLink
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as pb
from kvferry.v1 import sidecar_service_pb2_grpc as pb_grpc


class StandInSidecar(pb_grpc.SidecarServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.reports: list[Any] = []
        self.evictions: list[Any] = []
        self.stats: list[Any] = []
        self.events: asyncio.Queue[pb.WatchReleasesResponse] = asyncio.Queue()
        self.watchers = 0

    async def ReportRetention(self, request: Any, context: Any) -> Any:
        self.reports.append(request.retention)
        retention = pb.ReportRetentionResponse(retention=request.retention).retention
        retention.expire_time.FromSeconds(int(time.time()) + 600)
        return pb.ReportRetentionResponse(retention=retention)

    async def EvictRetention(self, request: Any, context: Any) -> Any:
        self.evictions.append(request)
        return pb.EvictRetentionResponse()

    async def ReportEngineStats(self, request: Any, context: Any) -> Any:
        self.stats.append(request.stats)
        return pb.ReportEngineStatsResponse()

    async def WatchReleases(self, request: Any, context: Any) -> AsyncIterator[Any]:
        self.watchers += 1
        yield pb.WatchReleasesResponse(type=pb.RELEASE_EVENT_TYPE_SYNC, live_engine_request_ids=["r-live"])
        while True:
            yield await self.events.get()


class Listener:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.unpublished: list[RetentionReport] = []
        self.gone: set[str] = set()

    def on_acknowledged(self, request_id: str, lease_expire_wall: float | None) -> None:
        self.calls.append(("ack", (request_id, lease_expire_wall)))

    def on_sync(self, live_request_ids: list[str]) -> None:
        self.calls.append(("sync", live_request_ids))

    def on_renewed(self, request_id: str, lease_expire_wall: float | None) -> None:
        self.calls.append(("renewed", (request_id, lease_expire_wall)))

    def on_ended(self, request_id: str, reason: EndReason) -> None:
        self.calls.append(("ended", (request_id, reason)))

    def unpublished_reports(self) -> list[RetentionReport]:
        return self.unpublished

    def still_retained(self, request_id: str) -> bool:
        return request_id not in self.gone

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]


async def _serve(sidecar: StandInSidecar, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    pb_grpc.add_SidecarServiceServicer_to_server(sidecar, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _eventually(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


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


async def test_reports_events_and_stats_flow_both_ways(link_parts: Any) -> None:
    loop, link, listener, port, accounting = link_parts
    sidecar = StandInSidecar()
    server = await _serve(sidecar, port)
    try:
        loop.start()
        link.start()
        await _eventually(lambda: link.connected and "sync" in listener.kinds())
        assert listener.calls[0] == ("sync", ["r-live"])
        link.report(REPORT)
        link.evict(Eviction("acme", "c0", "r0"))
        await _eventually(lambda: "ack" in listener.kinds() and bool(sidecar.evictions))
        (sent,) = sidecar.reports
        assert (sent.engine_request_id, list(sent.block_ids), sent.turn, sent.ttl_seconds) == (
            "r1",
            [1, 2],
            2,
            30,
        )
        assert list(sent.block_digests) == [b"\x01" * 16]
        acked = dict(listener.calls)["ack"]
        assert acked[0] == "r1" and acked[1] > time.time() + 500

        expire = Timestamp()
        expire.FromSeconds(int(time.time()) + 900)
        await sidecar.events.put(
            pb.WatchReleasesResponse(
                type=pb.RELEASE_EVENT_TYPE_RENEWED, engine_request_id="r1", expire_time=expire
            )
        )
        await sidecar.events.put(
            pb.WatchReleasesResponse(
                type=pb.RELEASE_EVENT_TYPE_ENDED,
                engine_request_id="r1",
                reason=resources_pb2.RELEASE_REASON_SUPERSEDED,
            )
        )
        await _eventually(lambda: "ended" in listener.kinds())
        calls = dict(listener.calls)
        assert calls["renewed"] == ("r1", float(expire.seconds))
        assert calls["ended"] == ("r1", EndReason.SUPERSEDED)

        accounting.set_retained_blocks(2)
        await _eventually(lambda: any(s.retained_blocks == 2 for s in sidecar.stats))
    finally:
        await server.stop(None)


async def test_calls_made_while_the_sidecar_is_away_are_delivered_when_it_returns(link_parts: Any) -> None:
    loop, link, listener, port, _ = link_parts
    listener.unpublished = [REPORT]
    loop.start()
    link.start()
    await asyncio.sleep(1.0)
    assert not link.connected
    link.evict(Eviction("acme", "c9", "r9"))
    stale = RetentionReport(**{**REPORT.__dict__, "request_id": "r-freed"})
    listener.gone.add("r-freed")
    link.report(stale)
    sidecar = StandInSidecar()
    server = await _serve(sidecar, port)
    try:
        # The link reconnects by itself (backoff <= 5 s), re-reports what was never acknowledged.
        await _eventually(lambda: bool(sidecar.reports) and bool(sidecar.evictions), within=15.0)
        assert sidecar.reports[0].engine_request_id == "r1"
        assert sidecar.evictions[0].engine_request_id == "r9"
        await asyncio.sleep(0.5)
        assert [r.engine_request_id for r in sidecar.reports] == ["r1"], "a freed retention is not published"
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
        await _eventually(lambda: bool(wakes), within=3.0)
        assert wakes[0] >= target - 0.01
        due[0] = None
        timer.poke()
        await asyncio.sleep(0.6)
        settled = len(wakes)
        await asyncio.sleep(0.6)
        assert len(wakes) == settled, "no wake-ups once nothing is due"
    finally:
        loop.stop()
