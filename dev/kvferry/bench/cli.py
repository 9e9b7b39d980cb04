"""``kvferry bench <name>``: each benchmark lives in its own module exposing ``configure(parser)`` and
``run(args) -> int``. Modules are imported to register their flags, so they keep heavy imports
(vLLM, torch, plotting) inside ``run``."""

from __future__ import annotations

import argparse
import importlib
import signal

BENCHMARKS: list[tuple[str, str, str]] = [
    ("registry", "kvferry.bench.registry", "registry throughput/latency and live-retention capacity"),
    ("router", "kvferry.bench.router", "latency the router adds per turn, and turns/s per router process"),
    ("multiturn", "kvferry.bench.multiturn", "multi-turn agent TTFT with reuse on/off, and hit rate vs gap"),
    ("idle", "kvferry.bench.idle", "CPU an idle engine burns with and without retained KV"),
    (
        "faults",
        "kvferry.bench.faults",
        "turns under injected faults, checked by the no-served-after-freed oracle",
    ),
    ("fence", "kvferry.bench.fence", "what pull-time fencing adds to the pull of a long retained prompt"),
    (
        "floor",
        "kvferry.bench.floor",
        "this machine's CPU floor for a relayed chunk and a request/answer exchange",
    ),
]


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, module_name, help_text in BENCHMARKS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as missing:
            if missing.name != module_name:
                raise
            continue
        child = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(child)
        child.set_defaults(_bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    # SIGTERM (`timeout`, a supervisor, a closed terminal) unwinds like an error, so each benchmark's own
    # cleanup stops the processes it started; a benchmark may put its own handler in place of this one.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    return int(args._bench_run(args))


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
