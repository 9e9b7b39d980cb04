"""``kvferry bench fence --nixl-only``: the fence's cost against the pull it checks, with real NIXL
agents and no engines (also ``python -m kvferry.bench.fence_nixl``, where vLLM is not installed).

Two processes, as a prefill and a decode engine are: a holder and a reader, each with a NIXL agent
configured as vLLM's worker configures its own (UCX, ``num_threads`` 4, telemetry on; the holder's
progress thread sleeping ``--holder-progress-delay-us`` between polls, as kvferry's
``nixl_progress_delay_us`` makes it), KV regions laid out as vLLM's (one region per layer x K/V,
``--device cpu``: host memory, ``cuda``: GPU memory) and a generation file (``kvferry.connector.generations``)
registered beside them. Each run, the reader does what the connector's worker does for one pull:
posts the data READ of ``--prompt-tokens`` tokens (one descriptor per region, as coalesced pulls are
posted), prepares the fence check (``PullFence.prepare``), spins until the data is DONE, then settles
the check (``PullFence.settle``: compares the holder's generations in its file, mapped since both run
on this host, as a prefill engine on its holder's host does; with ``--generations-over-nixl``, posts the
generation READ, waits for it and compares, as across hosts; then logs). Prints per
run the pull (posting to DONE), the fence (``fence_ms``: from the data done to the verdict), the
whole ``settle`` call (the fence plus its JSON log line), the preparation done while the data was in
flight, and the NIXL calls inside the fence; then the medians. The target (issue 13): fence at most
2 % of the pull at 16k tokens.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import multiprocessing
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

TARGET_FRACTION = 0.02
BLOCK_TOKENS = 16
# --device's defaults: the bench model's KV (4 layers, 4096 bytes a token) on CPU, Qwen3-8B's on GPU
# (36 layers, 147,456 bytes a token), as docs/calibration.md measures its pulls.
SHAPES = {"cpu": (4, 4096), "cuda": (36, 147456)}
# vLLM's worker builds its agent with these (kv_connector_extra_config "num_threads", default 4).
VLLM_NUM_THREADS = 4


@dataclass(frozen=True)
class NixlFenceRun:
    run: int
    blocks: int
    pulled_bytes: int
    pull_ms: float
    fence_ms: float
    settle_ms: float
    prepare_ms: float
    post_us: float
    polls: int
    poll_us: float
    release_us: float
    fenced: bool

    @property
    def fraction(self) -> float:
        return self.fence_ms / self.pull_ms if self.pull_ms > 0 else float("inf")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=sorted(SHAPES), default="cpu", help="where the KV regions live")
    parser.add_argument("--layers", type=int, default=None, help="layers (K and V: two regions each)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV bytes a token, all layers")
    parser.add_argument(
        "--generation-run-blocks",
        type=int,
        default=256,
        help="the holder's generations change every N blocks (1: each its own, the log line's worst case)",
    )
    parser.add_argument(
        "--prepare-at-done",
        action="store_true",
        help="prepare each check once its data is done (no PullFence.prepare): what preparing early saves",
    )
    parser.add_argument(
        "--holder-progress-delay-us", type=int, default=None, help="default: kvferry's nixl_progress_delay_us"
    )
    parser.add_argument(
        "--generations-over-nixl",
        action="store_true",
        help="READ the holder's generations over NIXL even though it runs on this host (default: compare "
        "them in its mapped file, as a prefill engine on the holder's host does)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.bench.fence_nixl", description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--fence-wait-us", type=int, default=None, help="default: kvferry's fence_wait_us")
    configure(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    from kvferry.connector.settings import KvferrySettings

    defaults = KvferrySettings()
    layers, token_bytes = SHAPES[args.device]
    layers = args.layers or layers
    token_bytes = args.kv_bytes_per_token or token_bytes
    delay_us = (
        defaults.nixl_progress_delay_us
        if args.holder_progress_delay_us is None
        else args.holder_progress_delay_us
    )
    wait_us = defaults.fence_wait_us if args.fence_wait_us is None else args.fence_wait_us
    blocks = max(1, args.prompt_tokens // BLOCK_TOKENS)
    region_block_bytes = token_bytes * BLOCK_TOKENS // (2 * layers)
    # Room for two pulls at different places on each side, so runs do not read the same blocks.
    num_blocks = 2 * blocks + 8
    shape = Shape(args.device, 2 * layers, num_blocks, region_block_bytes)
    print(
        f"NIXL-only fence bench: {args.device}, {layers} layers, {token_bytes} KV bytes a token, "
        f"{blocks} blocks ({blocks * BLOCK_TOKENS} tokens, "
        f"{blocks * region_block_bytes * 2 * layers / 2**20:.1f} MiB) a pull, "
        f"holder progress delay {delay_us} us, fence_wait_us {wait_us}, generations change every "
        f"{args.generation_run_blocks} blocks, generations read "
        f"{'over NIXL' if args.generations_over_nixl else 'in the mapped file'}; "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}",
        flush=True,
    )
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    holder = context.Process(
        target=_holder, args=(there, shape, delay_us, max(1, args.generation_run_blocks)), daemon=True
    )
    holder.start()
    there.close()
    try:
        runs = _reader(
            here,
            shape,
            blocks,
            args.runs,
            delay_us,
            wait_us / 1e6,
            max(1, args.generation_run_blocks),
            args.prepare_at_done,
            not args.generations_over_nixl,
        )
    finally:
        here.close()
        holder.join(timeout=30)
    print_table(runs)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) | {"fraction": r.fraction} for r in runs], indent=2))
    return 0 if runs and not any(r.fenced for r in runs) else 1


@dataclass(frozen=True)
class Shape:
    device: str
    regions: int
    num_blocks: int
    region_block_bytes: int

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.region_block_bytes


def _agent(name: str, delay_us: int) -> Any:
    """A NIXL agent as vLLM's worker builds it, with kvferry's progress-thread delay."""
    from kvferry.connector.vllm_internals import nixl_progress_thread_delay
    from nixl._api import nixl_agent, nixl_agent_config

    with nixl_progress_thread_delay(nixl_agent, delay_us):
        return nixl_agent(name, nixl_agent_config(num_threads=VLLM_NUM_THREADS, capture_telemetry=True))


class _Side:
    """One process's KV regions and generation file, registered with its agent."""

    def __init__(self, name: str, shape: Shape, delay_us: int) -> None:
        from kvferry.connector.generations import GenerationFile

        self.agent = _agent(name, delay_us)
        self.shape = shape
        self.file = GenerationFile.create(shape.num_blocks)
        address, nbytes = self.file.registration()
        self.agent.register_memory(self.agent.get_reg_descs([(address, nbytes, 0, "")], "DRAM"))
        if shape.device == "cuda":
            import torch

            self.regions: list[Any] = [
                torch.zeros(shape.region_bytes, dtype=torch.uint8, device="cuda")
                for _ in range(shape.regions)
            ]
            self.addresses = [int(r.data_ptr()) for r in self.regions]
            self.memory, self.device_id = "VRAM", 0
        else:
            self.regions = [np.zeros(shape.region_bytes, dtype=np.uint8) for _ in range(shape.regions)]
            self.addresses = [int(r.ctypes.data) for r in self.regions]
            self.memory, self.device_id = "DRAM", 0
        rows = [(a, shape.region_bytes, self.device_id, "") for a in self.addresses]
        self.agent.register_memory(self.agent.get_reg_descs(rows, self.memory))

    def rows(self, first_block: int, blocks: int, addresses: list[int] | None = None) -> np.ndarray:
        """One descriptor per region (this side's, or the peer's ``addresses``): ``blocks`` blocks from
        ``first_block`` (a coalesced pull's run)."""
        size = self.shape.region_block_bytes
        regions = self.addresses if addresses is None else addresses
        out = np.empty((len(regions), 3), dtype=np.uint64)
        out[:, 0] = np.asarray(regions, dtype=np.uint64) + first_block * size
        out[:, 1] = blocks * size
        out[:, 2] = self.device_id
        return out


def _holder(conn: Connection, shape: Shape, delay_us: int, run_blocks: int) -> None:
    side = _Side("fence-bench-holder", shape, delay_us)
    side.file.generations[:] = _generations(np.arange(shape.num_blocks), run_blocks)
    conn.send((side.agent.get_agent_metadata(), side.file.describe(), side.addresses))
    try:
        conn.recv()  # until the reader is done
    except EOFError:
        pass


def _generations(block_ids: np.ndarray, run_blocks: int) -> np.ndarray:
    """The holder's generations: one engine's random base, a bump more every ``run_blocks`` blocks."""
    return (np.asarray(block_ids, dtype=np.uint64) // np.uint64(run_blocks)) + np.uint64(2**40)


class _TimedAgent:
    """The reader's agent, timing the calls the fence makes (the bench's breakdown)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def _timed(self, name: str, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return getattr(self._agent, name)(*args)
        finally:
            self.seconds[name] += time.perf_counter() - started
            self.calls[name] += 1

    def transfer(self, handle: Any) -> Any:
        return self._timed("transfer", handle)

    def check_xfer_state(self, handle: Any) -> Any:
        return self._timed("check_xfer_state", handle)

    def release_xfer_handle(self, handle: Any) -> Any:
        return self._timed("release_xfer_handle", handle)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _json_log_to_nowhere() -> None:
    """The connector's JSON log lines, formatted as in an engine (on its logging thread), to an
    in-memory sink."""
    try:
        from kvferry.connector.logs import log_json_lines_to
    except ImportError:  # python-json-logger missing (the GPU machine without vLLM): plain lines
        handler = logging.StreamHandler(io.StringIO())
        handler.setFormatter(logging.Formatter("%(message)s"))
        root = logging.getLogger("kvferry")
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO)
        root.propagate = False
    else:
        log_json_lines_to(io.StringIO())


def _reader(
    conn: Connection,
    shape: Shape,
    blocks: int,
    runs: int,
    delay_us: int,
    wait_seconds: float,
    run_blocks: int,
    prepare_at_done: bool,
    map_same_host: bool,
) -> list[NixlFenceRun]:
    from kvferry.connector.fence import PulledBlocks, PullFence
    from kvferry.connector.logs import hand_over_held

    _json_log_to_nowhere()
    side = _Side("fence-bench-reader", shape, delay_us)
    metadata, array, holder_regions = conn.recv()
    holder = side.agent.add_remote_agent(metadata)
    agent = _TimedAgent(side.agent)
    fence = PullFence(agent, side.file, wait_seconds=wait_seconds, map_same_host=map_same_host)
    fence.add_peer(holder, array)
    # Two warm-ups: the first READ between two agents also connects them.
    results: list[NixlFenceRun] = []
    for index in range(runs + 2):
        local_first = 4 + (index % 2) * blocks
        remote_first = 4 + ((index + 1) % 2) * blocks
        local = list(range(local_first, local_first + blocks))
        remote = list(range(remote_first, remote_first + blocks))
        request_id = f"fence-bench-{index}"
        # As the worker: the expectation arrives with the step, the data READ is posted, the check prepared.
        fence.expect(
            request_id, _generations(np.arange(remote_first, remote_first + blocks), run_blocks).tolist()
        )
        started = time.perf_counter()
        handle = side.agent.initialize_xfer(
            "READ",
            side.agent.get_xfer_descs(side.rows(local_first, blocks), side.memory),
            side.agent.get_xfer_descs(side.rows(remote_first, blocks, holder_regions), side.memory),
            holder,
        )
        state = side.agent.transfer(handle)
        pulled = PulledBlocks("holder", "r", local, remote, [holder])
        if not prepare_at_done:
            fence.prepare(request_id, pulled)
        while state == "PROC":
            state = side.agent.check_xfer_state(handle)
        data_done = time.perf_counter()
        side.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"data READ ended {state}")
        agent.reset()
        settle_started = time.perf_counter()
        done: set[str] = {request_id}
        lookup = {request_id: pulled}.get
        answered, failed = fence.settle(done, set(), lookup)
        while request_id not in answered:  # a read slower than fence_wait_us: the next poll
            answered, failed = fence.settle(set(), set(), lookup)
        settled = time.perf_counter()
        # vLLM's next poll, no pull done: the fence releases the read, the connector hands lines over.
        fence.settle(set(), set(), lookup)
        hand_over_held()
        verdict = fence.verdicts[-1]
        if index < 2:
            continue
        result = NixlFenceRun(
            run=index - 2,
            blocks=blocks,
            pulled_bytes=blocks * shape.region_block_bytes * shape.regions,
            pull_ms=(data_done - started) * 1e3,
            fence_ms=verdict.fence_seconds * 1e3,
            settle_ms=(settled - settle_started) * 1e3,
            prepare_ms=verdict.prepare_seconds * 1e3,
            post_us=agent.seconds["transfer"] * 1e6,
            polls=agent.calls["check_xfer_state"],
            poll_us=agent.seconds["check_xfer_state"] * 1e6,
            release_us=agent.seconds["release_xfer_handle"] * 1e6,
            fenced=bool(verdict.fenced) or request_id in failed,
        )
        results.append(result)
        print(
            f"run {result.run}: pull {result.pull_ms:.3f} ms, fence {result.fence_ms * 1e3:.1f} us "
            f"({100 * result.fraction:.2f} %), settle with its log line {result.settle_ms * 1e3:.1f} us",
            flush=True,
        )
    conn.send(None)
    return results


def print_table(runs: list[NixlFenceRun]) -> None:
    if not runs:
        print("no runs measured")
        return
    print()
    print(
        f"{'run':>4} {'blocks':>6} {'MiB':>8} {'pull ms':>9} {'fence us':>9} {'fence %':>8} "
        f"{'settle us':>10} {'prep us':>8} {'post us':>8} {'polls':>6} {'poll us':>8} {'rel us':>7} "
        f"{'fenced':>7}"
    )
    for r in runs:
        print(
            f"{r.run:>4} {r.blocks:>6} {r.pulled_bytes / 2**20:>8.1f} {r.pull_ms:>9.3f} "
            f"{r.fence_ms * 1e3:>9.1f} {100 * r.fraction:>8.2f} {r.settle_ms * 1e3:>10.1f} "
            f"{r.prepare_ms * 1e3:>8.1f} {r.post_us:>8.1f} {r.polls:>6} {r.poll_us:>8.1f} "
            f"{r.release_us:>7.1f} {r.fenced!s:>7}"
        )

    def median(values: list[float]) -> float:
        return statistics.median(values)

    fraction = median([r.fraction for r in runs])
    verdict = "within" if fraction <= TARGET_FRACTION else "ABOVE"
    print(
        f"\nmedian of {len(runs)}: pull {median([r.pull_ms for r in runs]):.3f} ms, "
        f"fence {median([r.fence_ms for r in runs]) * 1e3:.1f} us, fence/pull {100 * fraction:.2f} % "
        f"({verdict} the {100 * TARGET_FRACTION:.0f} % target); settle with the log line "
        f"{median([r.settle_ms for r in runs]) * 1e3:.1f} us "
        f"({100 * median([r.settle_ms / r.pull_ms for r in runs]):.2f} % of the pull); prepared while the "
        f"data was in flight {median([r.prepare_ms for r in runs]) * 1e3:.1f} us"
    )


if __name__ == "__main__":
    sys.exit(main())
