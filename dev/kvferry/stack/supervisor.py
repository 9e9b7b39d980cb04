"""Keeps what ``kvferry up`` started running: a child that exits is cleared away with whatever it left
in its session (an engine's ``VLLM::EngineCore`` and workers) and started again after a growing pause.

Synchronous on purpose: ``kvferry up`` has nothing else to do while it supervises, and the checks are a
``poll()`` per child every half second.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.runtime.backoff import Backoff, BackoffPolicy
from kvferry.stack.processes import StackState, session_members, signal_session

# First restart after about a second (a sidecar's engine stays in service meanwhile), then longer
# pauses for a child that keeps crashing, up to half a minute.
RESTART_BACKOFF = BackoffPolicy(initial_seconds=1.0, max_seconds=30.0)
# A child that ran this long before it exited starts again after the shortest pause.
STABLE_SECONDS = 60.0
CHECK_SECONDS = 0.5
# How long a dead child's session may take to go after SIGKILL.
CLEAR_SECONDS = 5.0

Launch = Callable[[], "subprocess.Popen[bytes]"]


@dataclass
class Supervised:
    name: str
    # Starts the child and records it in the stack state (a restart replaces the record).
    launch: Launch
    process: subprocess.Popen[bytes]
    started: float
    backoff: Backoff = field(default_factory=lambda: Backoff(RESTART_BACKOFF))
    restart_at: float | None = None


class Supervisor:
    """Restarts the children it was given; ``announce`` hears every exit and restart (one line each: the
    terminal of ``kvferry up --foreground``, else ``logs/supervisor.log``), and the stack state records
    each exit's reason beside the restart count (``kvferry status``)."""

    def __init__(
        self,
        state: StackState,
        announce: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = state
        self._announce = announce
        self._clock = clock
        self._children: list[Supervised] = []

    def add(self, name: str, launch: Launch) -> subprocess.Popen[bytes]:
        """Starts ``name`` with ``launch`` and supervises it from now on."""
        process = launch()
        self._children.append(Supervised(name, launch, process, started=self._clock()))
        return process

    def check(self) -> None:
        """One round: clears and schedules the restart of children that exited; restarts those due."""
        now = self._clock()
        for child in self._children:
            if child.restart_at is None:
                code = child.process.poll()
                if code is None:
                    continue
                self._clear_session(child.name)
                if now - child.started >= STABLE_SECONDS:
                    child.backoff.reset()
                delay = child.backoff.next_delay()
                child.restart_at = now + delay
                reason = _exit_reason(code)
                self._state.note_exit(child.name, reason)
                self._announce(f"{child.name} exited ({reason}); restarting in {delay:.1f} s")
            elif now >= child.restart_at:
                child.restart_at = None
                child.started = now
                try:
                    child.process = child.launch()
                except (OSError, RuntimeError) as failure:
                    delay = child.backoff.next_delay()
                    child.restart_at = now + delay
                    self._state.note_exit(child.name, f"failed to start: {failure}")
                    self._announce(f"{child.name} failed to start ({failure}); retrying in {delay:.1f} s")
                    continue
                self._announce(f"{child.name} restarted (pid {child.process.pid})")

    def run(self) -> None:
        """Supervises until interrupted (a signal handler raising, or KeyboardInterrupt)."""
        while True:
            self.check()
            time.sleep(CHECK_SECONDS)

    def _clear_session(self, name: str) -> None:
        # An engine's API server may die while its EngineCore and workers (same session) live on,
        # holding gigabytes and a core: they go with it.
        for process in self._state.processes:
            if process.name == name:
                signal_session(process, signal.SIGKILL)
                # Gone before the restart: a new engine must not meet the old one's port or memory.
                deadline = time.monotonic() + CLEAR_SECONDS
                while session_members(process) and time.monotonic() < deadline:
                    time.sleep(0.05)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
