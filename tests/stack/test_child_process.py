"""Children started by the dev tooling: a real etcd started with ``die_with_parent`` ends when its parent
is SIGKILLed (no orphans), and a process that has used gRPC's async API starts children safely."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

STARTER = """
import sys, time
from pathlib import Path
from kvferry.stack.etcd_process import EtcdProcess
etcd = EtcdProcess(data_dir=Path(sys.argv[1]), die_with_parent=True)
etcd.start()
print(etcd.pid, flush=True)
time.sleep(120)
"""


def test_etcd_started_to_die_with_its_parent_ends_when_the_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path / "data")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        etcd_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(etcd_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(etcd_pid) and psutil.Process(etcd_pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "etcd outlived its killed parent"
            time.sleep(0.1)
    finally:
        parent.kill()


# A process that serves and calls gRPC (aio) keeps gRPC's threads running; a fork that then runs Python
# before exec (``preexec_fn``) aborted the child in about one start in twenty-five.
AFTER_GRPC = """
import asyncio, subprocess, sys
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvferry.stack.child_process import child_command

async def use_grpc():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return server

loop = asyncio.new_event_loop()
server = loop.run_until_complete(use_grpc())
command = child_command(["true"], die_with_parent=True, core=int(sys.argv[2]))
codes = [subprocess.Popen(command, start_new_session=True).wait() for _ in range(int(sys.argv[1]))]
print(sorted(set(codes)))
"""


def test_children_start_cleanly_after_grpc_aio_was_used() -> None:
    core = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-c", AFTER_GRPC, "150", str(core)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[0]", done.stderr[-2000:]
