"""NIXL READ of KV blocks laid out as vLLM lays them out, between two processes, against a torch copy.

The decode side ("D", the holder, GPU 0) and the prefill side ("P", the reader, GPU 1) each run in their own
process, as a decode and a prefill engine would; their NIXL agents exchange metadata over a loopback
socket pair (multiprocessing.Pipe). The KV cache is vLLM's FLASH_ATTN layout: one tensor per layer of shape
[2 (K, V), num_blocks, 16, num_kv_heads, head_dim], bf16, registered per layer; K and V of a layer are two
regions, so a block is one descriptor per layer x K/V.

Two ways of describing the same pull are timed:
- per_block: vLLM's way. Descriptor lists of every (region, block) prepared once at handshake
  (prep_xfer_dlist), then each pull selects one descriptor per layer x K/V x block (make_prepped_xfer).
- coalesced: runs of consecutive block ids on both sides merged into one descriptor per layer x K/V x run,
  built per pull (initialize_xfer).
Each pull's destination blocks are poisoned before and compared bit for bit with the source after.
A torch device-to-device copy of the same bytes (per layer x K/V run, and as one flat copy) is the baseline;
it runs in a third process that sees both GPUs.

Run: python tools/gpu/nixl_kv_transfer.py --out transfer.json   (on a machine with two GPUs and nixl-cu13)
Smoke test without GPUs: --device cpu --shapes tiny --tokens 64,256
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
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

# Run as a script from anywhere: the repository root makes tools.gpu importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.gpu.model_shapes import BLOCK_SIZE_TOKENS, SHAPES, TOKEN_COUNTS, ModelShape

HOLDER_DEVICE = 0
READER_DEVICE = 1
# Block ids start away from 0 on both sides (vLLM reserves block 0) and at different offsets.
SRC_FIRST_BLOCK = 7
DST_FIRST_BLOCK = 3
SPARE_BLOCKS = 64


def _torch_device(kind: str, index: int, isolate: bool) -> tuple[Any, int]:
    """The torch device a process uses and the device id NIXL descriptors carry for it."""
    import torch

    if kind == "cpu":
        return torch.device("cpu"), 0
    local_index = 0 if isolate else index
    torch.cuda.set_device(local_index)
    return torch.device("cuda", local_index), local_index


def _isolate_env(index: int, isolate: bool) -> None:
    # Read at CUDA initialisation, which has not happened yet in a fresh spawned process.
    if isolate:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)


def _allocate_kv(shape: ModelShape, num_blocks: int, device: Any) -> list[Any]:
    import torch

    return [
        torch.empty(
            (2, num_blocks, BLOCK_SIZE_TOKENS, shape.num_kv_heads, shape.head_dim),
            dtype=torch.bfloat16,
            device=device,
        )
        for _ in range(shape.num_layers)
    ]


def _fill_kv(caches: list[Any], seed: int) -> None:
    """Random bits per layer from a seeded generator, so the reader can rebuild the expected bytes."""
    import torch

    for layer, cache in enumerate(caches):
        generator = torch.Generator(device=cache.device)
        generator.manual_seed(seed * 100_003 + layer)
        bits = torch.randint(
            -32768, 32767, cache.shape, dtype=torch.int16, device=cache.device, generator=generator
        )
        cache.view(torch.int16).copy_(bits)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _region_bases(caches: list[Any], num_blocks: int, block_bytes: int) -> np.ndarray:
    """Base address of each layer x K/V region, in vLLM's region order (layer-major, K then V)."""
    bases = []
    for cache in caches:
        base = cache.data_ptr()
        bases.append(base)
        bases.append(base + num_blocks * block_bytes)
    return np.asarray(bases, dtype=np.uint64)


def block_layout(
    layout: str, num_blocks_needed: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Source (holder) and destination (reader) block ids for one pull.

    "contiguous": consecutive ids on both sides. "runsN": the source ids come in runs of N consecutive blocks
    whose order is shuffled (the destination stays contiguous), so at most N blocks merge into one descriptor.
    """
    dst = DST_FIRST_BLOCK + np.arange(num_blocks_needed, dtype=np.int64)
    if layout == "contiguous":
        return SRC_FIRST_BLOCK + np.arange(num_blocks_needed, dtype=np.int64), dst
    if not layout.startswith("runs"):
        raise ValueError(f"unknown layout {layout!r}")
    run_blocks = int(layout.removeprefix("runs"))
    runs = math.ceil(num_blocks_needed / run_blocks)
    order = rng.permutation(runs)
    src = SRC_FIRST_BLOCK + (order[:, None] * run_blocks + np.arange(run_blocks)[None, :]).reshape(-1)
    return src[:num_blocks_needed].astype(np.int64), dst


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs where both src and dst block ids advance by one: (src starts, dst starts, lengths)."""
    count = len(src)
    breaks = np.nonzero((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    ends = np.concatenate([breaks, [count]]).astype(np.int64)
    return src[starts], dst[starts], ends - starts


def _run_descs(
    bases: np.ndarray, starts: np.ndarray, lengths: np.ndarray, block_bytes: int, dev: int
) -> np.ndarray:
    """Nx3 (address, length, device) rows: every region x run."""
    addrs = bases[:, None] + (starts.astype(np.uint64) * np.uint64(block_bytes))[None, :]
    lens = np.broadcast_to((lengths.astype(np.uint64) * np.uint64(block_bytes))[None, :], addrs.shape)
    rows = np.empty((addrs.size, 3), dtype=np.uint64)
    rows[:, 0] = addrs.reshape(-1)
    rows[:, 1] = lens.reshape(-1)
    rows[:, 2] = dev
    return rows


def _holder(
    conn: Connection, shape_name: str, num_blocks: int, device_kind: str, isolate: bool, seed: int
) -> None:
    """Decode side: owns the KV, registers it, answers nothing but metadata; the reader does the work."""
    _isolate_env(HOLDER_DEVICE, isolate)
    from nixl._api import nixl_agent, nixl_agent_config

    shape = SHAPES[shape_name]
    device, dev_id = _torch_device(device_kind, HOLDER_DEVICE, isolate)
    caches = _allocate_kv(shape, num_blocks, device)
    _fill_kv(caches, seed)
    _sync(device)
    agent = nixl_agent(f"decode-{shape_name}", nixl_agent_config(backends=["UCX"]))
    t0 = time.perf_counter()
    reg = agent.register_memory(caches)
    register_s = time.perf_counter() - t0
    conn.send(
        {
            "metadata": agent.get_agent_metadata(),
            "bases": _region_bases(caches, num_blocks, shape.kv_block_bytes).tolist(),
            "device_id": dev_id,
            "register_s": register_s,
        }
    )
    conn.recv()  # the reader is done
    agent.deregister_memory(reg)
    conn.send("bye")


def _wait_done(agent: Any, handle: Any, state: str, deadline_s: float = 60.0) -> None:
    end = time.perf_counter() + deadline_s
    while state == "PROC":
        if time.perf_counter() > end:
            raise TimeoutError("NIXL transfer did not complete")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed: {state}")


def _telemetry(agent: Any, handle: Any) -> dict[str, int]:
    try:
        t = agent.get_xfer_telemetry(handle)
        return {
            "post_us": int(t.postDuration),
            "xfer_us": int(t.xferDuration),
            "desc_count": int(t.descCount),
        }
    except Exception:  # telemetry is optional in a build; the timings stand without it
        return {}


def _reader(
    conn: Connection,
    results: Connection,
    shape_name: str,
    num_blocks: int,
    tokens: list[int],
    fragmented_tokens: list[int],
    fragment_runs: list[int],
    device_kind: str,
    isolate: bool,
    seed: int,
    warmup: int,
    reps: int,
) -> None:
    """Prefill side: pulls the holder's blocks into its own cache, times and verifies each pull."""
    _isolate_env(READER_DEVICE, isolate)
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    shape = SHAPES[shape_name]
    device, dev_id = _torch_device(device_kind, READER_DEVICE, isolate)
    block_bytes = shape.kv_block_bytes
    dst_caches = _allocate_kv(shape, num_blocks, device)
    expected = _allocate_kv(shape, num_blocks, device)
    _fill_kv(expected, seed)
    _sync(device)
    agent = nixl_agent(f"prefill-{shape_name}", nixl_agent_config(backends=["UCX"], capture_telemetry=True))
    agent.register_memory(dst_caches)
    remote = conn.recv()
    t0 = time.perf_counter()
    remote_name = agent.add_remote_agent(remote["metadata"])
    add_remote_s = time.perf_counter() - t0
    remote_bases = np.asarray(remote["bases"], dtype=np.uint64)
    remote_dev = int(remote["device_id"])
    local_bases = _region_bases(dst_caches, num_blocks, block_bytes)
    num_regions = len(local_bases)

    # vLLM's handshake: every (region, block) descriptor prepared once on both sides.
    all_blocks = np.arange(num_blocks, dtype=np.int64)
    ones = np.ones(num_blocks, dtype=np.int64)
    t0 = time.perf_counter()
    local_prepped = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT",
        _run_descs(local_bases, all_blocks, ones, block_bytes, dev_id),
        "VRAM" if device.type == "cuda" else "DRAM",
    )
    remote_prepped = agent.prep_xfer_dlist(
        remote_name,
        _run_descs(remote_bases, all_blocks, ones, block_bytes, remote_dev),
        "VRAM" if device.type == "cuda" else "DRAM",
    )
    prep_dlists_s = time.perf_counter() - t0
    mem_type = "VRAM" if device.type == "cuda" else "DRAM"

    def poison(dst_ids: np.ndarray) -> None:
        idx = torch.as_tensor(dst_ids, device=device)
        for cache in dst_caches:
            cache.view(torch.int16).index_fill_(1, idx, -1)
        _sync(device)

    def verify(src_ids: np.ndarray, dst_ids: np.ndarray) -> bool:
        s_idx = torch.as_tensor(src_ids, device=device)
        d_idx = torch.as_tensor(dst_ids, device=device)
        for cache, want in zip(dst_caches, expected, strict=True):
            got = cache.view(torch.int16).index_select(1, d_idx)
            if not torch.equal(got, want.view(torch.int16).index_select(1, s_idx)):
                return False
        return True

    def pull_per_block(src_ids: np.ndarray, dst_ids: np.ndarray) -> dict[str, Any]:
        t_start = time.perf_counter()
        region_offsets = (np.arange(num_regions, dtype=np.int64) * num_blocks)[:, None]
        local_idx = (region_offsets + dst_ids[None, :]).reshape(-1).astype(np.int32)
        remote_idx = (region_offsets + src_ids[None, :]).reshape(-1).astype(np.int32)
        t_built = time.perf_counter()
        handle = agent.make_prepped_xfer(
            "READ", local_prepped, local_idx, remote_prepped, remote_idx, b"pulled"
        )
        t_made = time.perf_counter()
        state = agent.transfer(handle)
        t_posted = time.perf_counter()
        _wait_done(agent, handle, state)
        t_done = time.perf_counter()
        tele = _telemetry(agent, handle)
        agent.release_xfer_handle(handle)
        return {
            "descriptors": int(local_idx.size),
            "build_ms": (t_built - t_start) * 1e3,
            "make_ms": (t_made - t_built) * 1e3,
            "post_ms": (t_posted - t_made) * 1e3,
            "wait_ms": (t_done - t_posted) * 1e3,
            "total_ms": (t_done - t_start) * 1e3,
            **tele,
        }

    def pull_coalesced(src_ids: np.ndarray, dst_ids: np.ndarray) -> dict[str, Any]:
        t_start = time.perf_counter()
        src_starts, dst_starts, lengths = contiguous_runs(src_ids, dst_ids)
        local = agent.get_xfer_descs(
            _run_descs(local_bases, dst_starts, lengths, block_bytes, dev_id), mem_type
        )
        remote_descs = agent.get_xfer_descs(
            _run_descs(remote_bases, src_starts, lengths, block_bytes, remote_dev), mem_type
        )
        t_built = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote_descs, remote_name, b"pulled")
        t_made = time.perf_counter()
        state = agent.transfer(handle)
        t_posted = time.perf_counter()
        _wait_done(agent, handle, state)
        t_done = time.perf_counter()
        tele = _telemetry(agent, handle)
        agent.release_xfer_handle(handle)
        return {
            "descriptors": int(num_regions * len(lengths)),
            "build_ms": (t_built - t_start) * 1e3,
            "make_ms": (t_made - t_built) * 1e3,
            "post_ms": (t_posted - t_made) * 1e3,
            "wait_ms": (t_done - t_posted) * 1e3,
            "total_ms": (t_done - t_start) * 1e3,
            **tele,
        }

    pulls = {"per_block": pull_per_block, "coalesced": pull_coalesced}
    rng = np.random.default_rng(seed)
    cases = [(t, "contiguous") for t in tokens]
    cases += [(t, f"runs{n}") for t in fragmented_tokens for n in fragment_runs]
    records: list[dict[str, Any]] = []
    for token_count, layout in cases:
        n_blocks = math.ceil(token_count / BLOCK_SIZE_TOKENS)
        src_ids, dst_ids = block_layout(layout, n_blocks, rng)
        nbytes = n_blocks * block_bytes * num_regions
        for mode, pull in pulls.items():
            samples: list[dict[str, Any]] = []
            warmups: list[dict[str, Any]] = []
            verified = True
            for rep in range(warmup + reps):
                poison(dst_ids)
                sample = pull(src_ids, dst_ids)
                # Every pull is checked, warm-ups too: a fast wrong pull must not pass.
                verified = verified and verify(src_ids, dst_ids)
                (samples if rep >= warmup else warmups).append(sample)
            total = statistics.median(s["total_ms"] for s in samples)
            wait = statistics.median(s["wait_ms"] for s in samples)
            record = {
                "shape": shape_name,
                "tokens": token_count,
                "blocks": n_blocks,
                "layout": layout,
                "mode": mode,
                "bytes": nbytes,
                "descriptors": samples[0]["descriptors"],
                "total_ms": total,
                "total_ms_min": min(s["total_ms"] for s in samples),
                "total_ms_max": max(s["total_ms"] for s in samples),
                "build_ms": statistics.median(s["build_ms"] for s in samples),
                "make_ms": statistics.median(s["make_ms"] for s in samples),
                "post_ms": statistics.median(s["post_ms"] for s in samples),
                "wait_ms": wait,
                "gbps_total": nbytes / (total * 1e-3) / 1e9,
                "gbps_after_post": nbytes
                / ((wait + statistics.median(s["post_ms"] for s in samples)) * 1e-3)
                / 1e9,
                "nixl_desc_count": samples[0].get("desc_count"),
                "nixl_post_us": statistics.median(s.get("post_us", 0) for s in samples),
                "nixl_xfer_us": statistics.median(s.get("xfer_us", 0) for s in samples),
                "first_pull_ms": warmups[0]["total_ms"] if warmups else None,
                "verified": verified,
                "reps": reps,
            }
            records.append(record)
            print(
                f"nixl {shape_name:9s} {token_count:6d} tok {layout:10s} {mode:9s} "
                f"{record['descriptors']:7d} desc {nbytes / 1e9:7.3f} GB {total:9.2f} ms "
                f"{record['gbps_total']:7.1f} GB/s verified={verified}",
                flush=True,
            )
    setup = {
        "shape": shape_name,
        "register_holder_s": remote["register_s"],
        "add_remote_agent_s": add_remote_s,
        "prep_all_block_dlists_s": prep_dlists_s,
        "prepped_descriptors_per_side": num_regions * num_blocks,
    }
    conn.send("done")
    conn.recv()
    results.send({"setup": setup, "records": records})


def _torch_copy(
    results: Connection,
    shape_name: str,
    num_blocks: int,
    tokens: list[int],
    device_kind: str,
    warmup: int,
    reps: int,
) -> None:
    """Baseline: torch peer copies of the same bytes, GPU 0 -> GPU 1, per layer x K/V run and as one copy."""
    import torch

    shape = SHAPES[shape_name]
    if device_kind == "cpu":
        src_dev, dst_dev = torch.device("cpu"), torch.device("cpu")
    else:
        src_dev, dst_dev = torch.device("cuda", HOLDER_DEVICE), torch.device("cuda", READER_DEVICE)
    src = _allocate_kv(shape, num_blocks, src_dev)
    dst = _allocate_kv(shape, num_blocks, dst_dev)
    _fill_kv(src, 1)
    max_bytes = max(
        math.ceil(t / BLOCK_SIZE_TOKENS) * shape.kv_block_bytes * 2 * shape.num_layers for t in tokens
    )
    flat_src = torch.empty(max_bytes, dtype=torch.uint8, device=src_dev)
    flat_dst = torch.empty(max_bytes, dtype=torch.uint8, device=dst_dev)
    flat_src.random_()

    def sync_both() -> None:
        _sync(src_dev)
        _sync(dst_dev)

    records = []
    for token_count in tokens:
        n = math.ceil(token_count / BLOCK_SIZE_TOKENS)
        nbytes = n * shape.kv_block_bytes * 2 * shape.num_layers

        def per_region(n: int = n) -> None:
            for s, d in zip(src, dst, strict=True):
                d[:, DST_FIRST_BLOCK : DST_FIRST_BLOCK + n].copy_(
                    s[:, SRC_FIRST_BLOCK : SRC_FIRST_BLOCK + n], non_blocking=True
                )

        def flat(nbytes: int = nbytes) -> None:
            flat_dst[:nbytes].copy_(flat_src[:nbytes], non_blocking=True)

        for mode, fn in (("torch_per_region", per_region), ("torch_flat", flat)):
            times = []
            for rep in range(warmup + reps):
                sync_both()
                t0 = time.perf_counter()
                fn()
                sync_both()
                if rep >= warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            if mode == "torch_per_region":
                # Compared as int16: random bf16 bits include NaNs, which never compare equal.
                verified = all(
                    torch.equal(
                        d[:, DST_FIRST_BLOCK : DST_FIRST_BLOCK + n].to(src_dev).view(torch.int16),
                        s[:, SRC_FIRST_BLOCK : SRC_FIRST_BLOCK + n].view(torch.int16),
                    )
                    for s, d in zip(src, dst, strict=True)
                )
            else:
                verified = torch.equal(flat_dst[:nbytes].to(src_dev), flat_src[:nbytes])
            total = statistics.median(times)
            records.append(
                {
                    "shape": shape_name,
                    "tokens": token_count,
                    "blocks": n,
                    "layout": "contiguous",
                    "mode": mode,
                    "bytes": nbytes,
                    "descriptors": 2 * shape.num_layers if mode == "torch_per_region" else 1,
                    "total_ms": total,
                    "total_ms_min": min(times),
                    "total_ms_max": max(times),
                    "gbps_total": nbytes / (total * 1e-3) / 1e9,
                    "verified": verified,
                    "reps": reps,
                }
            )
            print(
                f"copy {shape_name:9s} {token_count:6d} tok {'contiguous':10s} {mode:16s} "
                f"{nbytes / 1e9:7.3f} GB {total:9.2f} ms {records[-1]['gbps_total']:7.1f} GB/s"
                f" verified={verified}",
                flush=True,
            )
    results.send({"records": records})


def run_shape(
    shape_name: str,
    tokens: list[int],
    fragmented_tokens: list[int],
    fragment_runs: list[int],
    device_kind: str,
    isolate: bool,
    warmup: int,
    reps: int,
    with_torch: bool,
    seed: int = 20261130,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    num_blocks = math.ceil(max(tokens + fragmented_tokens) / BLOCK_SIZE_TOKENS) + SPARE_BLOCKS
    holder_conn, reader_conn = ctx.Pipe()
    results_recv, results_send = ctx.Pipe(duplex=False)
    holder = ctx.Process(
        target=_holder, args=(holder_conn, shape_name, num_blocks, device_kind, isolate, seed)
    )
    reader = ctx.Process(
        target=_reader,
        args=(
            reader_conn,
            results_send,
            shape_name,
            num_blocks,
            tokens,
            fragmented_tokens,
            fragment_runs,
            device_kind,
            isolate,
            seed,
            warmup,
            reps,
        ),
    )
    holder.start()
    reader.start()
    out: dict[str, Any] = results_recv.recv()
    reader.join(120)
    holder.join(120)
    if reader.exitcode != 0 or holder.exitcode != 0:
        raise RuntimeError(f"transfer processes failed: reader={reader.exitcode} holder={holder.exitcode}")
    out["setup"]["isolated_devices"] = isolate
    if with_torch:
        copy_recv, copy_send = ctx.Pipe(duplex=False)
        copier = ctx.Process(
            target=_torch_copy, args=(copy_send, shape_name, num_blocks, tokens, device_kind, warmup, reps)
        )
        copier.start()
        out["records"] += copy_recv.recv()["records"]
        copier.join(120)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-32b")
    parser.add_argument("--tokens", default=",".join(str(t) for t in TOKEN_COUNTS))
    parser.add_argument(
        "--fragmented-tokens", default="8192", help="token counts also pulled with fragmented block ids"
    )
    parser.add_argument(
        "--fragment-runs", default="1,2,4,8,16,64", help="run lengths (blocks) of the fragmented layouts"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--isolate", action="store_true", help="CUDA_VISIBLE_DEVICES=one GPU per process, as vLLM engines run"
    )
    parser.add_argument("--no-torch", action="store_true", help="skip the torch copy baseline")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if t]
    fragmented = [int(t) for t in args.fragmented_tokens.split(",") if t]
    fragment_runs = [int(n) for n in args.fragment_runs.split(",") if n]
    result: dict[str, Any] = {
        "setup": [],
        "records": [],
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))},
    }
    for shape_name in args.shapes.split(","):
        out = run_shape(
            shape_name,
            tokens,
            fragmented,
            fragment_runs,
            args.device,
            args.isolate,
            args.warmup,
            args.reps,
            not args.no_torch,
        )
        result["setup"].append(out["setup"])
        result["records"] += out["records"]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    bad = [r for r in result["records"] if not r["verified"]]
    if bad:
        print(f"VERIFICATION FAILED for {len(bad)} records", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
