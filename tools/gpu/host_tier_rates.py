"""The host tier's two transports on one GPU (issue 19), with no engines: the decode side's copy of a
retention from its KV cache (GPU memory) into a pinned host pool, and the prefill side's NIXL READ of the
same blocks from that pool into its own KV cache, against a READ of them from the decode side's KV cache.

Two processes on the same GPU, as the one-GPU stack runs its engines: the holder ("D") owns a KV cache in
vLLM's FLASH_ATTN layout (one tensor per layer, [2 (K, V), blocks, 16, kv_heads, head_dim], bf16, seeded
random bits) and a host pool laid out the same way (a pinned tensor per layer, [2, slots, ...]: a slot holds
one block of every layer x K/V region, as ``kvferry.connector.host_tier`` lays out its pool), both registered
with NIXL (VRAM and DRAM). D times ``copy_`` of the retention's blocks into pool slots on a stream of its own
(what a GPU demotion would run), then answers metadata. The reader ("P") pulls the blocks with coalesced
descriptors (one per layer x K/V x run of consecutive ids, as kvferry's connector posts them) from D's KV
cache and from D's pool, each pull into poisoned blocks and checked bit for bit against the seeded source.

Run: python tools/gpu/host_tier_rates.py --out host-tier.json   (one GPU, torch with CUDA, nixl-cu13)
Smoke test without a GPU: --device cpu --shape tiny --tokens 256
"""

from __future__ import annotations

import argparse
import contextlib
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
from tools.gpu.model_shapes import BLOCK_SIZE_TOKENS, SHAPES
from tools.gpu.nixl_kv_transfer import (
    _allocate_kv,
    _fill_kv,
    _region_bases,
    _run_descs,
    _sync,
    _wait_done,
)

# The retention's blocks in D's KV cache, its slots in the pool, and P's destination: distinct offsets.
SRC_FIRST_BLOCK = 7
POOL_FIRST_SLOT = 2
DST_FIRST_BLOCK = 3
SEED = 20261206


def _device(kind: str) -> Any:
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _pool_elements(shape_name: str, slots: int) -> int:
    shape = SHAPES[shape_name]
    return shape.num_layers * 2 * slots * BLOCK_SIZE_TOKENS * shape.num_kv_heads * shape.head_dim


def _map_pool(path: str, shape_name: str, slots: int, pin: bool) -> list[Any]:
    """The host pool in a shared-memory file (``path``), one tensor per layer shaped as the KV cache's;
    pinned (cudaHostRegister) when a GPU copies to or from it. D and, for the mapped pull, P map the file."""
    import torch

    shape = SHAPES[shape_name]
    flat = torch.from_file(path, shared=True, size=_pool_elements(shape_name, slots), dtype=torch.bfloat16)
    if pin:
        status = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel() * flat.element_size(), 0)
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of the pool failed: {status}")
    return list(flat.view(shape.num_layers, 2, slots, BLOCK_SIZE_TOKENS, shape.num_kv_heads, shape.head_dim))


def _copy_blocks(dst: list[Any], dst_first: int, src: list[Any], src_first: int, n: int, stream: Any) -> None:
    """Copies ``n`` blocks of every layer x K/V region: one contiguous copy per region (a copy of the two
    regions at once is strided and goes through an unpinned host buffer: 1 GB/s on an H100)."""
    import torch

    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for to, frm in zip(dst, src, strict=True):
            for kv in range(2):
                to[kv, dst_first : dst_first + n].copy_(frm[kv, src_first : src_first + n], non_blocking=True)
    if stream is not None:
        stream.synchronize()


def _holder(
    conn: Connection,
    shape_name: str,
    num_blocks: int,
    tokens: list[int],
    device_kind: str,
    reps: int,
    pool_path: str,
) -> None:
    """D: the KV cache and the pool; times the demotion copies, registers both, answers metadata."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    shape = SHAPES[shape_name]
    device = _device(device_kind)
    caches = _allocate_kv(shape, num_blocks, device)
    _fill_kv(caches, SEED)
    with open(pool_path, "wb") as f:
        f.truncate(_pool_elements(shape_name, num_blocks) * 2)
    pool = _map_pool(pool_path, shape_name, num_blocks, pin=device.type == "cuda")
    for layer in pool:
        layer.fill_(0)  # every page written once, as the connector's pool is at engine start
    _sync(device)
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    copies: list[dict[str, Any]] = []
    for token_count in tokens:
        n = math.ceil(token_count / BLOCK_SIZE_TOKENS)
        samples = []
        for _ in range(reps + 1):
            _sync(device)
            started = time.perf_counter()
            _copy_blocks(pool, POOL_FIRST_SLOT, caches, SRC_FIRST_BLOCK, n, stream)
            samples.append(time.perf_counter() - started)
        nbytes = n * shape.kv_block_bytes * 2 * shape.num_layers
        seconds = statistics.median(samples[1:])  # the first copy of a size is a warm-up
        copies.append(
            {
                "tokens": token_count,
                "blocks": n,
                "bytes": nbytes,
                "copy_ms": seconds * 1e3,
                "copy_ms_min": min(samples[1:]) * 1e3,
                "copy_gbps": nbytes / seconds / 1e9,
            }
        )
        print(
            f"copy to pool {token_count:6d} tok {nbytes / 1e9:7.3f} GB {seconds * 1e3:8.2f} ms "
            f"{nbytes / seconds / 1e9:7.1f} GB/s",
            flush=True,
        )
    # The pool now holds the largest retention's blocks; every smaller one is its prefix.
    agent = nixl_agent("decode-host-tier", nixl_agent_config(backends=["UCX"]))
    registered = [agent.register_memory(caches), agent.register_memory(pool)]
    conn.send(
        {
            "metadata": agent.get_agent_metadata(),
            "kv_bases": _region_bases(caches, num_blocks, shape.kv_block_bytes).tolist(),
            "pool_bases": _region_bases(pool, num_blocks, shape.kv_block_bytes).tolist(),
            "copies": copies,
        }
    )
    conn.recv()  # the reader is done
    for handle in registered:
        agent.deregister_memory(handle)
    conn.send("bye")


def _reader(
    conn: Connection,
    results: Connection,
    shape_name: str,
    num_blocks: int,
    tokens: list[int],
    device_kind: str,
    warmup: int,
    reps: int,
    pool_path: str,
) -> None:
    """P: pulls the blocks from D's KV cache and, three ways, from D's pool; times and checks each pull.

    - kv_cache: NIXL READ from D's KV cache (GPU memory into GPU memory).
    - host_pool: NIXL READ from D's pool (host memory of another process into GPU memory).
    - host_pool_staged: NIXL READ from D's pool into P's own pinned host memory, then a copy into the GPU.
    - host_pool_mapped: P maps D's pool (the same shared-memory file, pinned in P too) and copies from it into
      the GPU itself: one host, no NIXL on the data path.
    """
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    shape = SHAPES[shape_name]
    device = _device(device_kind)
    on_gpu = device.type == "cuda"
    block_bytes = shape.kv_block_bytes
    dst_caches = _allocate_kv(shape, num_blocks, device)
    expected = _allocate_kv(shape, num_blocks, device)
    _fill_kv(expected, SEED)
    staging = [torch.empty_like(cache, device="cpu", pin_memory=on_gpu) for cache in dst_caches]
    _sync(device)
    stream = torch.cuda.Stream(device) if on_gpu else None
    agent = nixl_agent("prefill-host-tier", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(dst_caches)
    agent.register_memory(staging)
    remote = conn.recv()
    remote_name = agent.add_remote_agent(remote["metadata"])
    mapped_pool = _map_pool(pool_path, shape_name, num_blocks, pin=on_gpu)
    local_bases = _region_bases(dst_caches, num_blocks, block_bytes)
    staging_bases = _region_bases(staging, num_blocks, block_bytes)
    local_type = "VRAM" if on_gpu else "DRAM"
    kv_bases = np.asarray(remote["kv_bases"], dtype=np.uint64)
    pool_bases = np.asarray(remote["pool_bases"], dtype=np.uint64)

    def poison(dst_ids: np.ndarray) -> None:
        idx = torch.as_tensor(dst_ids, device=device)
        for cache in dst_caches:
            cache.view(torch.int16).index_fill_(1, idx, -1)
        _sync(device)

    def verify(dst_ids: np.ndarray) -> bool:
        s_idx = torch.as_tensor(SRC_FIRST_BLOCK + np.arange(len(dst_ids)), device=device)
        d_idx = torch.as_tensor(dst_ids, device=device)
        return all(
            torch.equal(
                cache.view(torch.int16).index_select(1, d_idx), want.view(torch.int16).index_select(1, s_idx)
            )
            for cache, want in zip(dst_caches, expected, strict=True)
        )

    def read(
        local: np.ndarray, local_mem: str, remote_bases: np.ndarray, first: int, remote_mem: str, n: int
    ) -> None:
        """One coalesced NIXL READ of ``n`` blocks (one descriptor per region: the ids are one run)."""
        starts, lengths = np.asarray([first]), np.asarray([n])
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(
                _run_descs(local, np.asarray([DST_FIRST_BLOCK]), lengths, block_bytes, 0), local_mem
            ),
            agent.get_xfer_descs(_run_descs(remote_bases, starts, lengths, block_bytes, 0), remote_mem),
            remote_name,
            b"pulled",
        )
        _wait_done(agent, handle, agent.transfer(handle))
        agent.release_xfer_handle(handle)

    def kv_cache(n: int) -> None:
        read(local_bases, local_type, kv_bases, SRC_FIRST_BLOCK, local_type, n)

    def host_pool(n: int) -> None:
        read(local_bases, local_type, pool_bases, POOL_FIRST_SLOT, "DRAM", n)

    def host_pool_staged(n: int) -> None:
        read(staging_bases, "DRAM", pool_bases, POOL_FIRST_SLOT, "DRAM", n)
        _copy_blocks(dst_caches, DST_FIRST_BLOCK, staging, DST_FIRST_BLOCK, n, stream)

    def host_pool_mapped(n: int) -> None:
        _copy_blocks(dst_caches, DST_FIRST_BLOCK, mapped_pool, POOL_FIRST_SLOT, n, stream)

    pulls = {
        "kv_cache": kv_cache,
        "host_pool": host_pool,
        "host_pool_staged": host_pool_staged,
        "host_pool_mapped": host_pool_mapped,
    }
    records: list[dict[str, Any]] = []
    for token_count in tokens:
        n = math.ceil(token_count / BLOCK_SIZE_TOKENS)
        dst_ids = DST_FIRST_BLOCK + np.arange(n, dtype=np.int64)
        nbytes = n * block_bytes * len(local_bases)
        for mode, pull in pulls.items():
            samples, verified = [], True
            for _ in range(warmup + reps):
                poison(dst_ids)
                started = time.perf_counter()
                pull(n)
                _sync(device)
                samples.append(time.perf_counter() - started)
                verified = verified and verify(dst_ids)  # warm-ups too: a fast wrong pull must not pass
            median = statistics.median(samples[warmup:])
            record = {
                "tokens": token_count,
                "blocks": n,
                "mode": mode,
                "bytes": nbytes,
                "descriptors": len(local_bases),
                "pull_ms": median * 1e3,
                "pull_ms_min": min(samples[warmup:]) * 1e3,
                "pull_ms_max": max(samples[warmup:]) * 1e3,
                "pull_gbps": nbytes / median / 1e9,
                "verified": verified,
                "reps": reps,
            }
            records.append(record)
            print(
                f"pull {mode:16s} {token_count:6d} tok {nbytes / 1e9:7.3f} GB {median * 1e3:9.2f} ms "
                f"{record['pull_gbps']:7.1f} GB/s verified={verified}",
                flush=True,
            )
    conn.send("done")
    conn.recv()
    results.send({"copies": remote["copies"], "pulls": records})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="4096,16384,24880")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",") if t]
    num_blocks = max(SRC_FIRST_BLOCK, POOL_FIRST_SLOT, DST_FIRST_BLOCK) + math.ceil(
        max(tokens) / BLOCK_SIZE_TOKENS
    )
    ctx = mp.get_context("spawn")
    holder_conn, reader_conn = ctx.Pipe()
    results_recv, results_send = ctx.Pipe(duplex=False)
    pool_path = f"/dev/shm/kvferry-host-pool-{os.getpid()}"
    holder = ctx.Process(
        target=_holder, args=(holder_conn, args.shape, num_blocks, tokens, args.device, args.reps, pool_path)
    )
    reader = ctx.Process(
        target=_reader,
        args=(
            reader_conn,
            results_send,
            args.shape,
            num_blocks,
            tokens,
            args.device,
            args.warmup,
            args.reps,
            pool_path,
        ),
    )
    holder.start()
    reader.start()
    try:
        out: dict[str, Any] = results_recv.recv()
        reader.join(120)
        holder.join(120)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pool_path)
    if reader.exitcode != 0 or holder.exitcode != 0:
        print(f"processes failed: reader={reader.exitcode} holder={holder.exitcode}", file=sys.stderr)
        return 1
    by_tokens: dict[int, dict[str, float]] = {}
    for record in out["pulls"]:
        by_tokens.setdefault(record["tokens"], {})[record["mode"]] = record["pull_ms"]
    out["host_over_kv_cache"] = {
        t: {mode: ms[mode] / ms["kv_cache"] for mode in ms if mode != "kv_cache"}
        for t, ms in by_tokens.items()
    }
    out["shape"] = args.shape
    out["env"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
    for token_count, ratios in out["host_over_kv_cache"].items():
        said = ", ".join(f"{mode} {ratio:.1f}x" for mode, ratio in ratios.items())
        print(f"pull time over the KV cache's at {token_count} tokens: {said}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if not all(record["verified"] for record in out["pulls"]):
        print("VERIFICATION FAILED", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
