"""``kvferry down``: stops everything ``kvferry up`` started (and nothing else)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvferry.stack.processes import StackState, stop_processes


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(".kvferry"),
        help="the work directory `kvferry up` used (default: .kvferry)",
    )


def run(args: argparse.Namespace) -> int:
    state = StackState.load(args.workdir)
    if not state.processes:
        print(f"nothing to stop (no processes recorded in {args.workdir / 'stack.json'})")
        return 0
    stopped = stop_processes(state)
    print("stopped: " + (", ".join(stopped) if stopped else "none were still running"))
    return 0
