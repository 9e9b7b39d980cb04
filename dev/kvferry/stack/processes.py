"""The processes ``kvferry up`` starts, recorded in ``<workdir>/stack.json`` so that ``kvferry down``
stops exactly those and nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
from kvferry.stack.etcd_process import EtcdProcess, free_port

STATE_FILE = "stack.json"


@dataclass
class StartedProcess:
    name: str
    pid: int
    command: list[str]
    log_path: str
    # Start time as the kernel reports it (psutil's create_time): a recycled pid is never mistaken for ours.
    started_at: float


@dataclass
class StackState:
    workdir: Path
    processes: list[StartedProcess] = field(default_factory=list)
    endpoints: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, workdir: Path) -> StackState:
        path = workdir / STATE_FILE
        if not path.exists():
            return cls(workdir=workdir)
        raw = json.loads(path.read_text())
        return cls(
            workdir=workdir,
            processes=[StartedProcess(**p) for p in raw.get("processes", [])],
            endpoints=dict(raw.get("endpoints", {})),
        )

    def save(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        payload = {"processes": [asdict(p) for p in self.processes], "endpoints": self.endpoints}
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(self.workdir / STATE_FILE)

    def record(self, name: str, pid: int, command: Sequence[str], log_path: Path) -> None:
        self.processes.append(
            StartedProcess(
                name=name,
                pid=pid,
                command=list(command),
                log_path=str(log_path),
                started_at=process_started_at(pid) or 0.0,
            )
        )
        self.save()


def process_started_at(pid: int) -> float | None:
    """When the process started (seconds since the epoch), or None if it is gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return None


def is_ours(process: StartedProcess) -> bool:
    started_at = process_started_at(process.pid)
    return started_at is not None and started_at == process.started_at


def spawn(
    name: str,
    command: Sequence[str],
    log_path: Path,
    state: StackState,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Starts ``command`` in its own session (it outlives ``kvferry up``), logging to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    state.record(name, proc.pid, command, log_path)
    return proc


def stop_processes(state: StackState, timeout_seconds: float = 20.0) -> list[str]:
    """SIGTERM every recorded process group still ours, in reverse start order; SIGKILL stragglers."""
    stopped: list[str] = []
    alive = [p for p in reversed(state.processes) if is_ours(p)]
    for process in alive:
        _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline and any(is_ours(p) for p in alive):
        time.sleep(0.2)
    for process in alive:
        if is_ours(process):
            _signal_group(process.pid, signal.SIGKILL)
        stopped.append(process.name)
    state.processes = []
    state.endpoints = {}
    state.save()
    return stopped


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # each process leads its own session, so its group is its children too
    except ProcessLookupError:
        pass


def start_etcd(etcd: EtcdProcess, state: StackState) -> None:
    """Starts the stack's own etcd and records it (``kvferry down`` stops it)."""
    etcd.start()
    assert etcd.pid is not None
    log_path = etcd.log_path or etcd.data_dir / "etcd.log"
    state.record("etcd", etcd.pid, ["etcd", f"--data-dir={etcd.data_dir}"], log_path)


def spawn_registry(
    kvferry: Sequence[str], etcd_endpoints: str, retention_ttl_seconds: float, logs: Path, state: StackState
) -> str:
    """Starts ``kvferry registry`` on a free loopback port; returns its address (not yet serving)."""
    address = f"127.0.0.1:{free_port()}"
    spawn(
        "registry",
        [
            *kvferry,
            "registry",
            "--listen",
            address,
            "--etcd-endpoints",
            etcd_endpoints,
            "--default-retention-ttl",
            str(retention_ttl_seconds),
        ],
        logs / "registry.log",
        state,
    )
    return address
