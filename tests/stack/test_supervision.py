"""Supervision and stopping with real processes (no engines): a killed child is cleared away with its
session and restarted; ``stop_processes`` stops what a dead session leader left behind."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kvferry.stack import status
from kvferry.stack.processes import (
    StackState,
    StartedProcess,
    process_started_at,
    session_members,
    spawn,
    stop_processes,
)
from kvferry.stack.status import supervision_lines
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
        # Persisted: `kvferry status` and `kvferry down` read the restart and its reason from stack.json.
        assert StackState.load(tmp_path).processes[0].pid == second.pid
        listed = supervision_lines(StackState.load(tmp_path), time.time())
        assert any(
            re.fullmatch(r"\s+worker\s+\d+\s+running\s+1  last exit \d+ s ago: killed by SIGKILL", line)
            for line in listed
        ), listed
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


def test_status_says_when_the_supervisor_is_dead_and_what_to_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = StackState(workdir=tmp_path)
    spawn("registry", ["sleep", "600"], tmp_path / "registry.log", state)
    supervisor = subprocess.Popen(["sleep", "600"], start_new_session=True)
    started_at = process_started_at(supervisor.pid)
    assert started_at is not None
    state.supervisor = StartedProcess("kvferry up", supervisor.pid, ["kvferry", "up"], "", started_at)
    state.save()
    try:
        assert status.run(argparse.Namespace(workdir=tmp_path)) == 0
        alive = capsys.readouterr().out
        assert f"supervisor: kvferry up (pid {supervisor.pid}) running; it restarts a process" in alive
        assert f"{tmp_path}/logs/supervisor.log" in alive
        supervisor.kill()  # as kill -9 would
        supervisor.wait()
        assert status.run(argparse.Namespace(workdir=tmp_path)) == 0
        dead = capsys.readouterr().out
        assert f"supervisor: kvferry up (pid {supervisor.pid}) is NOT running" in dead, dead
        assert "a process that exits now stays down" in dead
        assert "`kvferry down` stops what is left, then `kvferry up` starts a supervised stack again" in dead
        assert re.search(r"^\s+registry\s+\d+\s+running\s+0$", dead, re.M), dead
    finally:
        stop_processes(state, timeout_seconds=5)
        supervisor.kill()
        supervisor.wait()
