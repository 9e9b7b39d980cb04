"""The host tier's copies through kvferry's own classes on one GPU (issue 19), no engines.

Two processes on the same device, as the one-GPU stack runs its engines. The holder ("D") has a KV cache in
vLLM's FLASH_ATTN layout (one tensor per layer, [2 (K, V), blocks, 16, kv_heads, head_dim], bf16, seeded
random bytes) and the connector's :class:`kvferry.connector.host_tier.HostPool` over it (a shared-memory
file, pinned, filled by :class:`kvferry.connector.copies.CudaCopier`): it times the move of a retention's
blocks into pool slots as a demotion runs it (ordered after the calling thread's work, planned and started
on a thread of its own). The reader ("P") maps D's pool
(:class:`~kvferry.connector.host_tier.MappedHostPool`) and copies the slots into its own KV cache with its
copier, in the runs the connector's mapped pull posts (:func:`kvferry.connector.copies.merge_runs`); every
copy lands in poisoned blocks and is compared bit for bit with D's seeded source.

Run: python tools/gpu/host_tier_copies.py --out host-tier-copies.json   (a GPU, torch with CUDA)
Smoke test without a GPU: --device cpu --shape tiny --tokens 256 (memmove, kvferry's HostCopier)
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# Run as a script from anywhere: the repository root makes tools.gpu importable; kvferry's connector root too.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "connector")]
from kvferry.connector.copies import copier_for, merge_runs  # noqa: E402
from kvferry.connector.host_tier import HostPool, HostPoolLayout, MappedHostPool  # noqa: E402

from tools.gpu.model_shapes import BLOCK_SIZE_TOKENS, SHAPES  # noqa: E402

# The retention's blocks in D's KV cache, its slots in the pool, and P's destination: distinct offsets.
SRC_FIRST_BLOCK = 7
POOL_FIRST_SLOT = 2
DST_FIRST_BLOCK = 3
SEED = 20261207


def _kv_cache(shape_name: str, layout: str, blocks: int, device: str, seed: int | None) -> list[Any]:
    """One tensor per layer, seeded random bytes (None: zeros): ``kv-first`` is [2 (K, V), blocks, 16,
    kv_heads, head_dim] (vLLM's FLASH_ATTN shape), ``blocks-first`` [blocks, 2, ...] (a block's K and V side
    by side, as vLLM lays the cache out for NIXL on the GPU stack)."""
    import torch

    shape = SHAPES[shape_name]
    inner = (BLOCK_SIZE_TOKENS, shape.num_kv_heads, shape.head_dim)
    dims = (2, blocks, *inner) if layout == "kv-first" else (blocks, 2, *inner)
    layers = []
    for layer in range(shape.num_layers):
        tensor = torch.zeros(dims, dtype=torch.bfloat16, device=device)
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed + layer)
            raw = torch.randint(
                0, 256, (tensor.numel() * 2,), dtype=torch.uint8, device=device, generator=generator
            )
            tensor.view(torch.uint8).view(-1).copy_(raw)
        layers.append(tensor)
    return layers


def _blocks(tensor: Any, layout: str, first: int, count: int) -> Any:
    """Blocks ``first .. first + count`` of a layer's tensor, K and V."""
    return tensor[:, first : first + count] if layout == "kv-first" else tensor[first : first + count]


def _rows(layers: list[Any], layout: str) -> np.ndarray:
    """vLLM's descriptor rows: per layer its K region's blocks, then its V region's."""
    rows: list[tuple[int, int, int]] = []
    for tensor in layers:
        for kv in range(2):
            region = tensor[kv] if layout == "kv-first" else tensor[:, kv]
            block_bytes = region[0].numel() * region.element_size()
            step = region.stride(0) * region.element_size()
            base = region.data_ptr()
            rows += [(base + b * step, block_bytes, 0) for b in range(region.shape[0])]
    return np.asarray(rows, dtype=np.uint64)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _holder(conn: Connection, args: argparse.Namespace, blocks: int, slots: int) -> None:
    layers = _kv_cache(args.shape, args.layout, blocks, args.device, SEED)
    _sync(args.device)
    copier = copier_for(layers)
    started = time.perf_counter()
    pool = HostPool(_rows(layers, args.layout), [blocks] * (2 * len(layers)), slots, copier)
    make_s = time.perf_counter() - started
    moves: list[dict[str, Any]] = []
    mover = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvferry-host-moves")
    for tokens in args.tokens:
        n = math.ceil(tokens / BLOCK_SIZE_TOKENS)
        ids = list(range(SRC_FIRST_BLOCK, SRC_FIRST_BLOCK + n))
        targets = list(range(POOL_FIRST_SLOT, POOL_FIRST_SLOT + n))
        times = []
        for _ in range(args.warmup + args.reps):
            started = time.perf_counter()
            # As the decode worker moves: ordered after this thread's work, planned and started on another.
            after = copier.checkpoint()
            nbytes, copy = mover.submit(pool.copy_in, ids, targets, after).result()
            copy.wait()
            times.append(time.perf_counter() - started)
        best = statistics.median(times[args.warmup :])
        moves.append({"tokens": tokens, "bytes": nbytes, "ms": best * 1e3, "gbps": nbytes / best / 1e9})
    conn.send({"layout": asdict(pool.layout()), "moves": moves, "pool_make_s": make_s, "copier": copier.name})
    conn.recv()  # P is done with the pool
    mover.shutdown()


def _reader(conn: Connection, args: argparse.Namespace, blocks: int) -> None:
    import torch

    answer = conn.recv()
    raw = answer["layout"]
    layout = HostPoolLayout(**{**raw, "regions": tuple(tuple(r) for r in raw["regions"])})
    layers = _kv_cache(args.shape, args.layout, blocks, args.device, None)
    expected = _kv_cache(args.shape, args.layout, blocks, args.device, SEED)
    copier = copier_for(layers)
    started = time.perf_counter()
    mapped, why = MappedHostPool.open(layout, copier)
    map_s = time.perf_counter() - started
    if mapped is None:
        conn.send({"error": f"cannot map D's pool: {why}"})
        return
    own = _rows(layers, args.layout)
    regions = 2 * len(layers)
    pulls: list[dict[str, Any]] = []
    for tokens in args.tokens:
        n = math.ceil(tokens / BLOCK_SIZE_TOKENS)
        region_ids = np.repeat(np.arange(regions, dtype=np.int64), n)
        slot_ids = np.tile(np.arange(POOL_FIRST_SLOT, POOL_FIRST_SLOT + n, dtype=np.int64), regions)
        holder = layout.slot_addresses(region_ids, slot_ids)
        destination = own[
            (region_ids * blocks + DST_FIRST_BLOCK + np.tile(np.arange(n), regions)).astype(np.int64)
        ]
        times, verified = [], True
        for _ in range(args.warmup + args.reps):
            for tensor in layers:
                _blocks(tensor, args.layout, DST_FIRST_BLOCK, n).view(torch.uint8).fill_(0xEE)
            _sync(args.device)
            started = time.perf_counter()
            runs = merge_runs(destination[:, 0], mapped.local(holder[:, 0]), holder[:, 1])
            mapped.copier.start(runs).wait()
            times.append(time.perf_counter() - started)
            verified &= all(
                torch.equal(
                    _blocks(got, args.layout, DST_FIRST_BLOCK, n).view(torch.uint8),
                    _blocks(want, args.layout, SRC_FIRST_BLOCK, n).view(torch.uint8),
                )
                for got, want in zip(layers, expected, strict=True)
            )
        nbytes = int(holder[:, 1].sum())
        best = statistics.median(times[args.warmup :])
        pulls.append(
            {
                "tokens": tokens,
                "bytes": nbytes,
                "runs": len(runs),
                "ms": best * 1e3,
                "gbps": nbytes / best / 1e9,
                "verified": bool(verified),
            }
        )
    conn.send({"pulls": pulls, "map_s": map_s})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    parser.add_argument("--layout", choices=("blocks-first", "kv-first"), default="blocks-first")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 24880])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    largest = math.ceil(max(args.tokens) / BLOCK_SIZE_TOKENS)
    blocks = SRC_FIRST_BLOCK + largest + 1
    slots = POOL_FIRST_SLOT + largest + 1
    context = mp.get_context("spawn")
    to_holder, holder_end = context.Pipe()
    to_reader, reader_end = context.Pipe()
    holder = context.Process(target=_holder, args=(holder_end, args, blocks, slots))
    reader = context.Process(target=_reader, args=(reader_end, args, blocks))
    holder.start()
    reader.start()
    try:
        made = to_holder.recv()
        to_reader.send(made)
        read = to_reader.recv()
        to_holder.send("done")
    finally:
        for process in (reader, holder):
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
    result = {"args": vars(args), **made, **read}
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    if "error" in read:
        print(read["error"])
        return 1
    print(
        f"D: pool made in {made['pool_make_s']:.2f} s ({made['copier']}); P: mapped in {read['map_s']:.2f} s"
    )
    for move, pull in zip(made["moves"], read["pulls"], strict=True):
        print(
            f"{move['tokens']:>6} tokens {move['bytes'] / 1e9:.2f} GB: D's move {move['ms']:.1f} ms "
            f"({move['gbps']:.1f} GB/s); P's mapped pull {pull['ms']:.1f} ms ({pull['gbps']:.1f} GB/s, "
            f"{pull['runs']} runs, verified {pull['verified']})"
        )
    return 0 if all(p["verified"] for p in read["pulls"]) else 1


if __name__ == "__main__":
    sys.exit(main())
