"""A real etcd started with ``die_with_parent`` ends when its parent is SIGKILLed (no orphans)."""

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
