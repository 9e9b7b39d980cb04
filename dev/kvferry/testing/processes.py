"""Child processes the fault harness starts, kills with SIGKILL and starts again.

Each child is started through :func:`kvferry.stack.child_process.child_command`, so the kernel SIGKILLs
it when the harness dies (no ``preexec_fn``: the harness's test process runs gRPC aio, whose fork
handlers can crash a child forked with one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.stack.child_process import child_command


def launcher_command(command: Sequence[str]) -> list[str]:
    """``command`` wrapped so that it is SIGKILLed when the harness dies."""
    return child_command(command, die_with_parent=True, death_signal="KILL")


@dataclass
class ManagedProcess:
    """One named child with its log file; :meth:`kill9` and :meth:`start` again at will."""

    name: str
    command: list[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)
    kills: int = 0
    starts: int = 0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        if self.alive:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                launcher_command(self.command),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self.starts += 1

    def kill9(self) -> None:
        """SIGKILL, no clean shutdown (its process group: anything it started dies too)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self.kills += 1
        self._proc.wait()

    def stop(self, timeout_seconds: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None


def wait_until(check: object, timeout_seconds: float, what: str, interval: float = 0.05) -> None:
    """Polls ``check()`` until truthy; TimeoutError naming ``what`` otherwise."""
    assert callable(check)
    deadline = time.monotonic() + timeout_seconds
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_seconds} s")
        time.sleep(interval)
