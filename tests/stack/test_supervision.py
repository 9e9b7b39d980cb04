"""Supervision and stopping with real processes (no engines): a killed child is cleared away with its
session and restarted; ``stop_processes`` stops what a dead session leader left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from kvferry.stack.processes import StackState, session_members, spawn, stop_processes
from kvferry.stack.supervisor import Supervisor

# A leader that starts a child of its own (as vLLM's API server starts EngineCore), then waits.
LEADER_WITH_CHILD = ["sh", "-c", "sleep 600 & wait"]


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_killed_child_is_cleared_with_its_session_and_restarted(tmp_path: Path) -> None:
    state = StackState(workdir=tmp_path)
    announced: list[str] = []
    supervisor = Supervisor(state, announce=announced.append)
    supervisor.add("worker", lambda: spawn("worker", LEADER_WITH_CHILD, tmp_path / "worker.log", state))

    def announced_after_check(count: int) -> bool:
        supervisor.check()
        return len(announced) >= count

    try:
        first = state.processes[0]
        wait_for(lambda: len(session_members(first)) == 2, 5, "the leader's child did not start")
        orphan = next(pid for pid in session_members(first) if pid != first.pid)
        os.kill(first.pid, signal.SIGKILL)
        wait_for(lambda: announced_after_check(1), 5, "the exit was not seen")
        assert announced[0].startswith("worker exited (killed by SIGKILL); restarting in ")
        assert session_members(first) == [], "the dead leader's child outlived it"
        assert not Path(f"/proc/{orphan}").exists() or "Z" in Path(f"/proc/{orphan}/stat").read_text()
        wait_for(lambda: announced_after_check(2), 5, "no restart")
        assert announced[1].startswith("worker restarted (pid ")
        second = state.processes[0]
        assert second.pid != first.pid and second.restarts == 1 and session_members(second)
        # Persisted: `kvferry status` and `kvferry down` read the restart from stack.json.
        assert StackState.load(tmp_path).processes[0].pid == second.pid
    finally:
        stop_processes(state, timeout_seconds=5)


def test_stop_processes_stops_what_a_dead_leader_left_behind(tmp_path: Path) -> None:
    state = StackState(workdir=tmp_path)
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        spawn("engine", LEADER_WITH_CHILD, tmp_path / "engine.log", state)
        leader = state.processes[0]
        wait_for(lambda: len(session_members(leader)) == 2, 5, "the leader's child did not start")
        os.kill(leader.pid, signal.SIGKILL)
        wait_for(lambda: leader.pid not in session_members(leader), 5, "the leader did not die")
        assert StackState.load(tmp_path).running(), "leftovers of a dead leader count as running"
        assert stop_processes(state, timeout_seconds=5) == ["engine"]
        assert session_members(leader) == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
