"""What a child process does between fork and exec, for the processes kvferry starts."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM to this process when the thread that started it exits (Linux prctl), even by SIGKILL:
    tests and benchmarks leave no etcd or engine behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
