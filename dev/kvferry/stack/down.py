"""``kvferry down``: stops everything ``kvferry up`` started (and nothing else), from any directory.

The supervisor (``kvferry up``) is asked first, so nothing is restarted while the stack stops; then
whatever is left of each recorded process's session is stopped too, also when ``kvferry up`` or a
session's leader (an engine's API server) was killed and left children behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from kvferry.stack.processes import StackState, is_ours, session_members, stop_processes
from kvferry.stack.settings import add_workdir_flag

SUPERVISOR_STOP_SECONDS = 60.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir_flag(parser)


def run(args: argparse.Namespace) -> int:
    state = StackState.load(args.workdir)
    if not state.running():
        print(f"nothing to stop (nothing recorded in {args.workdir / 'stack.json'} still runs)")
        return 0
    running = [p.name for p in state.processes if session_members(p)]
    supervisor = state.supervisor
    if supervisor is not None and is_ours(supervisor):
        os.kill(supervisor.pid, signal.SIGTERM)
        deadline = time.monotonic() + SUPERVISOR_STOP_SECONDS
        while is_ours(supervisor) and time.monotonic() < deadline:
            time.sleep(0.2)
        if is_ours(supervisor):
            os.kill(supervisor.pid, signal.SIGKILL)
    stop_processes(state)  # what the supervisor did not stop (it was killed, or it gave up)
    state.supervisor = None
    state.save()
    print("stopped: " + (", ".join(running) if running else "kvferry up (its children had exited)"))
    return 0
