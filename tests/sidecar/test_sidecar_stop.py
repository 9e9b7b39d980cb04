"""A sidecar's stop is bounded: it returns, and frees its port, while the connector's WatchReleases stream
is open and its registration loop is being woken (the connector's stats reports, engine state changes).

A REAL registry on a REAL etcd (tests/fixtures/registry.py); the engine is a STAND-IN HTTP server.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from kvferry.sidecar.registration import Phase

from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import SidecarFactory, StandInEngineFactory
from tests.sidecar.helpers import Releases, find_engine

pytestmark = pytest.mark.timeout(60)

STOP_WITHIN_SECONDS = 10.0


async def test_a_sidecar_stops_while_its_registration_is_woken_and_a_release_stream_is_open(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    engine = await stand_in_engine_factory()
    engine_id = unique("engine")
    handle = await sidecar_factory(engine_url=engine.url, engine_id=engine_id, role="decode", nixl_port=5631)
    await handle.wait_registered()
    releases = Releases(handle.stub(), engine_id, release_grace_seconds=2.0)
    await releases.next_sync()
    sidecar = handle.sidecar

    # The stop cancels the sidecar's loops newest first: the release fan-out, then the registration loop,
    # in the very turn the fan-out ends. A wake then (a connector's stats report, an engine state change)
    # is the worst moment: the registration loop is cancelled within a turn of its event being set.
    fanout = next(
        task
        for task in asyncio.all_tasks()
        if getattr(getattr(task.get_coro(), "cr_frame", None), "f_locals", {}).get("self") is sidecar.fanout
    )

    async def wake_as_the_fanout_ends() -> None:
        # Watched turn by turn (an event or a done callback would add turns of its own).
        while not fanout.done():  # noqa: ASYNC110
            await asyncio.sleep(0)
        for _ in range(3):
            sidecar.registration.poke()
            await asyncio.sleep(0)

    waker = asyncio.create_task(wake_as_the_fanout_ends())
    # The heartbeat that publishes the connector's grace is over: the registration loop waits for its next.
    await asyncio.sleep(0.5)
    stopping = asyncio.create_task(sidecar.stop())
    done, _ = await asyncio.wait({stopping}, timeout=STOP_WITHIN_SECONDS)
    waker.cancel()
    assert stopping in done, f"the sidecar's stop did not return within {STOP_WITHIN_SECONDS} s"
    stopping.result()
    handle.stopped = True
    assert sidecar.registration.phase is Phase.STOPPED, "the registration loop ran on after the stop"
    # The connector's stream ended, the engine left the registry, nothing listens on the port any more.
    while await releases.next(within=5) is not None:
        pass
    assert await find_engine(registry.stub(), engine_id) is None
    port = int(handle.address.rpartition(":")[2])
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0, "the gRPC server still listens"
