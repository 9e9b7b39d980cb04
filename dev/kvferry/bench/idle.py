"""``kvferry bench idle``: CPU an idle engine burns with and without retained KV.

For each connector (kvferry's, and vLLM's plain NixlConnector as the baseline) it starts one
prefill + one decode engine, measures every engine process's CPU seconds over an idle window,
runs a few multi-turn conversations (so the decode engine retains their KV), measures another
idle window, and prints a table. Takes the engine lock (/tmp/kvferry-engines.lock) itself.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvferry.connector.logs import FREED_LOG

if TYPE_CHECKING:
    from kvferry.stack.engine import ConnectorKind

ENGINE_LOCK = Path("/tmp/kvferry-engines.lock")


@dataclass(frozen=True)
class Sample:
    connector: str
    phase: str
    engine: str
    process: str
    cpu_seconds: float
    window_seconds: float


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="length of each idle window")
    parser.add_argument(
        "--connectors",
        default="kvferry,nixl",
        help="comma-separated: kvferry (kvferry's), nixl (vLLM's plain)",
    )
    parser.add_argument(
        "--conversations", type=int, default=3, help="conversations run before the 2nd window"
    )
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="engine logs go here (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the samples as JSON here")
    parser.add_argument("--threads", action="store_true", help="also print the busiest threads per window")
    parser.add_argument(
        "--no-lock", action="store_true", help="do not take the engine lock (caller holds it)"
    )


def run(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvferry-bench-idle-"))
    connectors = [c.strip() for c in str(args.connectors).split(",") if c.strip()]
    for name in connectors:
        if name not in ("kvferry", "nixl"):
            print(f"unknown connector {name!r}; use kvferry and/or nixl", file=sys.stderr)
            return 2
    lock = None
    if not args.no_lock:
        lock = open(ENGINE_LOCK, "a")
        print(f"waiting for {ENGINE_LOCK} ...", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        samples: list[Sample] = []
        for name in connectors:
            samples += measure_connector("kvferry" if name == "kvferry" else "nixl", args, workdir)
    finally:
        if lock is not None:
            lock.close()
    print_table(samples)
    if args.json:
        args.json.write_text(json.dumps([asdict(s) for s in samples], indent=2))
    print(f"engine logs: {workdir}")
    return 0


def measure_connector(connector: ConnectorKind, args: argparse.Namespace, workdir: Path) -> list[Sample]:
    from kvferry.connector.settings import KvferrySettings
    from kvferry.stack.engine import engine_pair

    # Retentions must outlive the measurement: an hour-long hard cap, no sidecar, and a grace
    # longer than the run, so superseded turns are not freed inside the window (each free wakes
    # the engine for one step, after which vLLM's worker spins ~1 s: its shm queue's busy loop).
    settings = KvferrySettings(max_retention_seconds=3600.0, release_grace_seconds=900.0)
    prefill, decode = engine_pair(workdir, settings=settings, connector=connector, prefix=f"idle-{connector}")
    print(f"[{connector}] starting engines (logs in {workdir}) ...", flush=True)
    prefill.start()
    decode.start()
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        time.sleep(3.0)
        samples = _window(connector, "idle, nothing retained", (prefill, decode), args)
        asyncio.run(_conversations(prefill.http_url, decode.http_url, prefill.served_model_name, args))
        time.sleep(3.0)
        samples += _window(connector, "idle, KV retained", (prefill, decode), args)
        return samples
    finally:
        prefill.stop()
        decode.stop()


async def _conversations(prefill_url: str, decode_url: str, model: str, args: argparse.Namespace) -> None:
    from kvferry.pd.chat import ChatMessage, ChatRequest
    from kvferry.pd.engine_client import VllmEngineClient
    from kvferry.pd.kvferry_params import ConversationMark
    from kvferry.stack.engine import direct_turn

    async with (
        VllmEngineClient(prefill_url, model) as prefill,
        VllmEngineClient(decode_url, model) as decode,
    ):
        for c in range(args.conversations):
            history = await prefill.render_chat(
                ChatRequest.of([ChatMessage("user", f"Conversation {c}: tell me about dataclasses. " * 20)])
            )
            previous = None
            for turn in range(1, args.turns + 1):
                mark = ConversationMark(tenant="bench", conversation_id=f"idle-{c}", turn=turn)
                result = await direct_turn(
                    prefill, decode, history, mark=mark, previous=previous, max_tokens=16
                )
                previous = result.retained
                follow_up = await prefill.render_chat(
                    ChatRequest.of([ChatMessage("user", f"Turn {turn + 1}, go on.")])
                )
                history = [*history, *result.output_token_ids, *follow_up]


def _window(connector: str, phase: str, engines: tuple[Any, ...], args: argparse.Namespace) -> list[Sample]:
    import psutil

    procs: dict[tuple[str, str], psutil.Process] = {}
    for engine in engines:
        for pid in engine.process_ids():
            try:
                proc = psutil.Process(pid)
                procs[(f"{engine.role}:{engine.engine_id}", f"{_kind(proc)}[{pid}]")] = proc
            except psutil.NoSuchProcess:
                continue

    def cpu() -> dict[tuple[str, str], float]:
        out = {}
        for key, proc in procs.items():
            try:
                times = proc.cpu_times()
                out[key] = times.user + times.system
            except psutil.NoSuchProcess:
                out[key] = 0.0
        return out

    def threads() -> dict[tuple[str, int, str], float]:
        out = {}
        for key, proc in procs.items():
            try:
                for thread in proc.threads():
                    name = _thread_name(proc.pid, thread.id)
                    out[(key[1], thread.id, name)] = thread.user_time + thread.system_time
            except psutil.NoSuchProcess:
                continue
        return out

    print(f"[{connector}] measuring '{phase}' for {args.idle_seconds:.0f} s ...", flush=True)
    frees_before = sum(_count_frees(engine) for engine in engines)
    before, threads_before = cpu(), threads()
    started = time.monotonic()
    time.sleep(args.idle_seconds)
    after, threads_after = cpu(), threads()
    window = time.monotonic() - started
    frees = sum(_count_frees(engine) for engine in engines) - frees_before
    if frees:
        print(f"    ({frees} retention(s) freed inside the window)")
    if args.threads:
        deltas = sorted(
            ((after_t - threads_before.get(k, 0.0), k) for k, after_t in threads_after.items()), reverse=True
        )
        for delta, (proc_name, tid, name) in deltas[:8]:
            if delta > 0.01:
                print(f"    {proc_name} thread {tid} {name}: {delta:.2f} cpu-s")
    return [
        Sample(
            connector,
            phase,
            engine,
            process,
            round(after[(engine, process)] - before[(engine, process)], 3),
            window,
        )
        for engine, process in procs
    ]


def _count_frees(engine: Any) -> int:
    try:
        return int(engine.log_path.read_text(errors="replace").count(f'"msg": "{FREED_LOG}"'))
    except OSError:
        return 0


def _kind(proc: Any) -> str:
    name = str(proc.name())
    if "EngineCore" in name:
        return "engine-core"
    if "Worker" in name:
        return "worker"
    try:
        cmdline = " ".join(proc.cmdline())
    except Exception:
        cmdline = ""
    if "api_server" in cmdline:
        return "api-server"
    return name


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def print_table(samples: list[Sample]) -> None:
    print()
    print(f"{'connector':<9} {'phase':<24} {'engine':<28} {'process':<22} {'cpu-s':>7} {'% core':>7}")
    for s in samples:
        if (
            s.cpu_seconds < 0.005
            and "api" not in s.process
            and "core" not in s.process
            and "worker" not in s.process
        ):
            continue
        share = 100.0 * s.cpu_seconds / s.window_seconds if s.window_seconds else 0.0
        row = f"{s.connector:<9} {s.phase:<24} {s.engine:<28} {s.process:<22}"
        print(f"{row} {s.cpu_seconds:>7.2f} {share:>6.1f}%")
    print()
    print(f"{'connector':<9} {'phase':<24} {'engine':<28} {'total cpu-s':>11} {'% core':>7}")
    totals: dict[tuple[str, str, str], tuple[float, float]] = {}
    for s in samples:
        key = (s.connector, s.phase, s.engine)
        cpu, window = totals.get(key, (0.0, s.window_seconds))
        totals[key] = (cpu + s.cpu_seconds, window)
    for (connector, phase, engine), (cpu, window) in totals.items():
        print(f"{connector:<9} {phase:<24} {engine:<28} {cpu:>11.2f} {100.0 * cpu / window:>6.1f}%")
