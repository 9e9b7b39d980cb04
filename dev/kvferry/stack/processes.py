"""The processes ``kvferry up`` starts, recorded in ``<workdir>/stack.json`` so that ``kvferry down``
stops exactly those and nothing else.

Every child starts in a session of its own, so the session id is the recorded pid, and what the child
starts (vLLM's ``VLLM::EngineCore`` and its workers) stays in that session. Linux does not hand out a pid
again while a session of that id has members, so "a process in session <recorded pid> that started no
earlier than the recorded process" is ours even after the recorded leader died: ``kvferry down`` and the
supervisor stop those too.
"""

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
# In ``<workdir>/logs``: what the detached supervisor prints (every exit and restart of a process).
SUPERVISOR_LOG = "supervisor.log"


@dataclass
class StartedProcess:
    name: str
    pid: int
    command: list[str]
    log_path: str
    # Start time as the kernel reports it (psutil's create_time): a recycled pid is never mistaken for ours.
    started_at: float
    # How often the supervisor restarted it.
    restarts: int = 0
    # Why it last exited ("killed by SIGKILL", "exit code 1", "failed to start: ...") and when (seconds
    # since the epoch), as the supervisor saw it; empty: it never exited. ``kvferry status`` shows both.
    last_exit: str = ""
    last_exit_at: float = 0.0


@dataclass
class StackState:
    workdir: Path
    processes: list[StartedProcess] = field(default_factory=list)
    endpoints: dict[str, str] = field(default_factory=dict)
    # The ``kvferry up`` process that supervises the others (``kvferry down`` stops it first).
    supervisor: StartedProcess | None = None

    @classmethod
    def load(cls, workdir: Path) -> StackState:
        path = workdir / STATE_FILE
        if not path.exists():
            return cls(workdir=workdir)
        raw = json.loads(path.read_text())
        supervisor = raw.get("supervisor")
        return cls(
            workdir=workdir,
            processes=[StartedProcess(**p) for p in raw.get("processes", [])],
            endpoints=dict(raw.get("endpoints", {})),
            supervisor=StartedProcess(**supervisor) if supervisor else None,
        )

    def save(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        payload = {
            "processes": [asdict(p) for p in self.processes],
            "endpoints": self.endpoints,
            "supervisor": asdict(self.supervisor) if self.supervisor else None,
        }
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(self.workdir / STATE_FILE)

    def record(self, name: str, pid: int, command: Sequence[str], log_path: Path) -> None:
        """Records a started process; a restart of ``name`` replaces its entry and counts the restart."""
        started = StartedProcess(
            name=name,
            pid=pid,
            command=list(command),
            log_path=str(log_path),
            started_at=process_started_at(pid) or 0.0,
        )
        for index, known in enumerate(self.processes):
            if known.name == name:
                started.restarts = known.restarts + 1
                started.last_exit, started.last_exit_at = known.last_exit, known.last_exit_at
                self.processes[index] = started
                break
        else:
            self.processes.append(started)
        self.save()

    @property
    def supervisor_log(self) -> Path:
        """Where the detached supervisor says every exit and restart."""
        return self.workdir / "logs" / SUPERVISOR_LOG

    def note_exit(self, name: str, reason: str) -> None:
        """Records why ``name`` exited, now (kept across its restart: :meth:`record`)."""
        for known in self.processes:
            if known.name == name:
                known.last_exit, known.last_exit_at = reason, time.time()
        self.save()

    def running(self) -> bool:
        """Whether the supervisor or any recorded process (or what is left of its session) still runs."""
        if self.supervisor is not None and is_ours(self.supervisor):
            return True
        return any(session_members(p) for p in self.processes)


def process_started_at(pid: int) -> float | None:
    """When the process started (seconds since the epoch), or None if it is gone."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return None


def is_ours(process: StartedProcess) -> bool:
    started_at = process_started_at(process.pid)
    return started_at is not None and started_at == process.started_at


def session_members(process: StartedProcess) -> list[int]:
    """The live processes of ``process``'s session: the leader if it is still ours, and whatever it
    started that is left (also after the leader died)."""
    members: list[int] = []
    for candidate in psutil.process_iter():
        try:
            if (
                os.getsid(candidate.pid) == process.pid
                and candidate.create_time() >= process.started_at
                and candidate.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
            ):
                members.append(candidate.pid)
        except (psutil.Error, OSError):
            continue  # gone meanwhile
    return members


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
    """SIGTERM every recorded process's session, in reverse start order, then SIGKILL what is left of
    them (an engine's ``VLLM::EngineCore`` and workers too, even when the API server already died)."""
    stopped: list[str] = []
    alive = [p for p in reversed(state.processes) if session_members(p)]
    for process in alive:
        signal_session(process, signal.SIGTERM)
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline and any(session_members(p) for p in alive):
        time.sleep(0.2)
    for process in alive:
        signal_session(process, signal.SIGKILL)
        stopped.append(process.name)
    state.processes = []
    state.endpoints = {}
    state.save()
    return stopped


def signal_session(process: StartedProcess, sig: signal.Signals) -> None:
    """Sends ``sig`` to every live member of ``process``'s session (see :func:`session_members`)."""
    for pid in session_members(process):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def start_etcd(etcd: EtcdProcess, state: StackState) -> None:
    """Starts the stack's own etcd and records it (``kvferry down`` stops it)."""
    etcd.start()
    assert etcd.pid is not None
    log_path = etcd.log_path or etcd.data_dir / "etcd.log"
    state.record("etcd", etcd.pid, etcd.command(), log_path)


def registry_command(
    kvferry: Sequence[str], etcd_endpoints: str, retention_ttl_seconds: float, listen: str = ""
) -> tuple[str, list[str]]:
    """The command of a ``kvferry registry`` on ``listen`` (host:port; empty: a free loopback port), and
    that address (start it with :func:`spawn`, or hand it to the supervisor)."""
    address = listen or f"127.0.0.1:{free_port()}"
    command = [
        *kvferry,
        "registry",
        "--listen",
        address,
        "--etcd-endpoints",
        etcd_endpoints,
        "--default-retention-ttl",
        str(int(retention_ttl_seconds)),
    ]
    return address, command
