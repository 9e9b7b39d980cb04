"""``kvferry bench faults``: multi-turn conversations through real etcd (3 members), registry replicas,
sidecars and router, with stand-in engines that run the connector's real retention machinery, while
every fault kind of issue 13 is injected; then the oracle (kvferry.testing.oracle) checks that no
block was served after D freed it, that every fenced pull became a recompute, and that no block leaked.

Prints turns answered / reused / recomputed / failed, faults injected per kind, fenced pulls,
served-after-freed and leaked blocks; exits 1 when the oracle finds a violation. Progress (the run's phases,
and every ~10 s the faults and turns so far) goes to standard error.

Needs the kvferry-dev distribution (``tools/setup`` installs it): the harness (kvferry.testing) lives there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=1000, help="turns to run in all")
    parser.add_argument("--faults-per-kind", type=int, default=100, help="faults injected of every kind")
    parser.add_argument(
        "--kinds", default="all", help="comma-separated fault kinds (default: all; see --list-kinds)"
    )
    parser.add_argument("--list-kinds", action="store_true", help="print the fault kinds and exit")
    parser.add_argument("--conversations", type=int, default=12, help="conversations the turns go to")
    parser.add_argument("--concurrency", type=int, default=3, help="turns in flight at once")
    parser.add_argument("--hold-seconds", type=float, default=1.5, help="how long each fault lasts")
    parser.add_argument("--seed", type=int, default=13, help="seed of the fault order and the prompts")
    parser.add_argument("--workdir", type=Path, default=None, help="logs go here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    try:
        from kvferry.testing.fault_run import run_faults
        from kvferry.testing.fault_stack import FaultKind, StackSettings
    except ModuleNotFoundError as missing:
        print(
            f"kvferry bench faults needs a source checkout set up by tools/setup ({missing})", file=sys.stderr
        )
        return 2
    if args.list_kinds:
        for kind in FaultKind:
            print(kind.value)
        return 0
    try:
        kinds = (
            list(FaultKind) if args.kinds == "all" else [FaultKind(k.strip()) for k in args.kinds.split(",")]
        )
    except ValueError as bad:
        print(f"{bad}; see --list-kinds", file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvferry-bench-faults-"))
    result = run_faults(
        StackSettings(work_dir=workdir, hold_seconds=args.hold_seconds),
        turns=args.turns,
        faults_per_kind=args.faults_per_kind,
        kinds=kinds,
        conversations=args.conversations,
        concurrency=args.concurrency,
        seed=args.seed,
        progress=lambda line: print(f"[faults] {line}", file=sys.stderr, flush=True),
    )
    summary = result.summary()
    _print(summary, workdir)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 1 if summary["violations"] else 0


def _print(summary: dict[str, Any], workdir: Path) -> None:
    turns = summary["turns"]
    oracle = summary["oracle"]
    print(f"kvferry bench faults: {summary['seconds']} s, logs in {workdir}")
    print(
        f"turns: {turns['sent']} sent, {turns['answered']} answered, {turns['reused']} reused retained KV, "
        f"{turns['recomputed']} recomputed, {turns['failed']} failed after retries, "
        f"{turns['refused_concurrent']} refused as concurrent"
    )
    print(f"faults: {summary['faults_total']} injected")
    for kind, count in sorted(summary["faults"].items()):
        print(f"  {kind:26s} {count}")
    for kind, error in sorted(summary["inject_errors"].items()):
        print(f"  {kind} could not always be injected: {error}")
    print(
        f"pulls: {oracle['pulls']} ({oracle['failed_pulls']} failed), fenced {summary['fenced']} "
        f"(not recomputed: {oracle['fenced_not_recomputed']})"
    )
    print(f"frees: {oracle['frees']} {oracle['frees_by_reason']}, unconfirmed {oracle['unconfirmed_frees']}")
    print(f"served after freed: {summary['served_after_freed']}")
    print(f"leaked blocks: {summary['leaked_blocks']} (held at end: {summary['held_blocks_at_end']})")
    for problem in summary["violations"]:
        print(f"VIOLATION: {problem}")
    for example in oracle["examples"]:
        print(f"  e.g. {example}")
