"""What a host-tier move's copy calls cost the thread beside them (issue 19), on a GPU, without engines.

A decode engine's step runs Python on its own thread while kvferry's mover thread starts a move's copies
(``CudaCopier.start``: one run per KV region and block range, 72 for a Qwen3-8B-shaped cache). Each call into
torch from Python may hand the GIL over and back, the step thread waiting. This tool times a stand-in step
(Python bookkeeping, small kernels, a sync) on the main thread while a mover thread starts parts of
32 blocks (back to back, or ``--gap-ms`` apart), the copies started one ``copy_`` per run (as
``CudaCopier.start`` does), in one ``torch._foreach_copy_`` call, or by address through the CUDA driver
(one ``cuMemcpyAsync`` per run, or all in one ``cuMemcpyBatchAsync``).
Rounds alternate, and each way's bytes are checked:

    PYTHONPATH=connector python3 tools/gpu/copy_calls.py [--rounds 3] [--seconds 4] [--gap-ms 0]

``per_run_blocking`` is ``per_run`` waited for on a blocking CUDA event (the mover sleeps, not spins).

Prints one JSON object: per condition (none, per_run, per_run_blocking, batched, driver, driver_batch) the
step's p50 and p90, the parts started and how long starting a part took the mover (p50, wall and its thread's
CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from kvferry.connector.copies import CudaCopier, Run

LAYERS = 36  # Qwen3-8B; K and V are regions of their own: 72 runs a part
BLOCK_BYTES = 16 * 8 * 128 * 2  # 16 tokens x 8 KV heads x 128 x bf16, per region
BLOCKS = 1024
SLOTS = 256
PART_BLOCKS = 32


def finish(done: Any) -> None:
    """Waits for a part: the copier's CopyDone (``CudaCopier.start``) or a CUDA event (the other ways)."""
    if hasattr(done, "wait"):
        done.wait()
    else:
        done.synchronize()


def on_copier_stream(copier: CudaCopier, issue: Callable[[torch.cuda.Stream], object]) -> Any:
    """Runs ``issue(stream)`` on the copier's stream, after what the current stream queued; returns an event
    recorded after it (as ``CudaCopier.start`` orders its copies)."""
    with torch.cuda.device(copier.device):
        stream = copier._stream
        stream.wait_stream(torch.cuda.current_stream(copier.device))
        with torch.cuda.stream(stream):
            issue(stream)
            event = torch.cuda.Event()
            event.record(stream)
    return event


def batched_start(copier: CudaCopier, runs: Sequence[Run]) -> Any:
    """The same copies in one ``torch._foreach_copy_`` call: one trip through the dispatcher (and the GIL)."""
    destinations = [copier._view(d, n) for d, _, n in runs]
    sources = [copier._view(s, n) for _, s, n in runs]
    return on_copier_stream(copier, lambda _: torch._foreach_copy_(destinations, sources, non_blocking=True))


_DRIVER = ctypes.CDLL("libcuda.so.1")
_DRIVER.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
_DRIVER.cuMemcpyAsync.restype = ctypes.c_int


def driver_start(copier: CudaCopier, runs: Sequence[Run]) -> Any:
    """The same copies by address through the driver (``cuMemcpyAsync``, unified addressing): no tensor
    views, and ctypes lets the GIL go for each call."""

    def issue(stream: torch.cuda.Stream) -> None:
        for destination, source, nbytes in runs:
            status = _DRIVER.cuMemcpyAsync(destination, source, nbytes, stream.cuda_stream)
            if status != 0:
                raise SystemExit(f"cuMemcpyAsync failed: CUresult {status}")

    return on_copier_stream(copier, issue)


class _Location(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _CopyAttributes(ctypes.Structure):
    # CUmemcpyAttributes: srcAccessOrder, srcLocHint, dstLocHint, flags
    _fields_ = (
        ("src_access_order", ctypes.c_int),
        ("src_location", _Location),
        ("dst_location", _Location),
        ("flags", ctypes.c_uint),
    )


_SRC_ACCESS_ORDER_STREAM = 1
# CUDA 13's cuMemcpyBatchAsync (the 12.8 one took a failIdx before the stream).
_BATCH = getattr(_DRIVER, "cuMemcpyBatchAsync_v2", None)
if _BATCH is not None:
    _BATCH.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.POINTER(_CopyAttributes),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    _BATCH.restype = ctypes.c_int


def driver_batch_start(copier: CudaCopier, runs: Sequence[Run]) -> Any:
    """The same copies in one driver call (``cuMemcpyBatchAsync``)."""
    if _BATCH is None:
        raise SystemExit("this driver has no cuMemcpyBatchAsync_v2")
    count = len(runs)
    destinations = (ctypes.c_uint64 * count)(*(d for d, _, _ in runs))
    sources = (ctypes.c_uint64 * count)(*(s for _, s, _ in runs))
    sizes = (ctypes.c_size_t * count)(*(n for _, _, n in runs))
    attributes = _CopyAttributes(_SRC_ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0), 0)
    first = (ctypes.c_size_t * 1)(0)

    def issue(stream: torch.cuda.Stream) -> None:
        status = _BATCH(
            destinations, sources, sizes, count, ctypes.byref(attributes), first, 1, stream.cuda_stream
        )
        if status != 0:
            raise SystemExit(f"cuMemcpyBatchAsync failed: CUresult {status}")

    return on_copier_stream(copier, issue)


def blocking_start(copier: CudaCopier, runs: Sequence[Run]) -> Any:
    """``CudaCopier.start``, then waited for on a blocking event (``cudaEventBlockingSync``): the mover sleeps
    until the copy is done instead of spinning in the driver beside the step's launches."""
    copier.start(runs)
    with torch.cuda.device(copier.device):
        event = torch.cuda.Event(blocking=True)
        event.record(copier._stream)
    return event


class Mover(threading.Thread):
    """Starts parts back to back, waiting for each, cycling through the parts given."""

    def __init__(
        self, start_part: Callable[[Sequence[Run]], Any], parts: list[list[Run]], gap_seconds: float
    ) -> None:
        super().__init__(daemon=True)
        self.start_part, self.parts, self.gap_seconds = start_part, parts, gap_seconds
        self.stop = threading.Event()
        self.started_parts = 0
        self.start_ms: list[float] = []
        self.start_cpu_ms: list[float] = []

    def run(self) -> None:
        while not self.stop.is_set():
            began, began_cpu = time.perf_counter(), time.thread_time()
            done = self.start_part(self.parts[self.started_parts % len(self.parts)])
            self.start_ms.append((time.perf_counter() - began) * 1000)
            self.start_cpu_ms.append((time.thread_time() - began_cpu) * 1000)
            finish(done)
            self.started_parts += 1
            if self.gap_seconds:
                self.stop.wait(self.gap_seconds)


def step_times(seconds: float, work: torch.Tensor) -> list[float]:
    """The stand-in step, in ms: Python bookkeeping (a scheduler's), 300 small kernels, then a sync."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        book: dict[int, int] = {}
        for i in range(3000):
            book[i % 97] = book.get(i % 97, 0) + i
        for _ in range(300):  # an eager forward pass launches its kernels one by one
            work.add_(1.0)
        # A step waits for its own stream (vLLM reads the sampled tokens back), not for the copier's.
        torch.cuda.current_stream().synchronize()
        times.append((time.perf_counter() - began) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--gap-ms", type=float, default=0.0, help="pause between parts (0: back to back)")
    args = parser.parse_args()
    region_bytes = BLOCKS * BLOCK_BYTES
    regions = [
        torch.randint(0, 255, (region_bytes,), dtype=torch.uint8, device="cuda") for _ in range(2 * LAYERS)
    ]
    copier = CudaCopier(regions)
    pool_region = SLOTS * BLOCK_BYTES
    pool = mmap.mmap(-1, len(regions) * pool_region)
    base = ctypes.addressof(ctypes.c_uint8.from_buffer(pool))
    copier.add_host_range(base, len(regions) * pool_region)
    parts = [
        [
            (
                base + index * pool_region + slot * BLOCK_BYTES,
                region.data_ptr() + block * BLOCK_BYTES,
                PART_BLOCKS * BLOCK_BYTES,
            )
            for index, region in enumerate(regions)
        ]
        for slot, block in zip(range(0, SLOTS, PART_BLOCKS), range(0, BLOCKS, PART_BLOCKS * 3), strict=False)
    ]
    work = torch.zeros(1024, device="cuda")
    step_times(1.0, work)  # warm up
    ways: dict[str, Callable[[Sequence[Run]], Any] | None] = {
        "none": None,
        "per_run": copier.start,
        "per_run_blocking": lambda runs: blocking_start(copier, runs),
        "batched": lambda runs: batched_start(copier, runs),
        "driver": lambda runs: driver_start(copier, runs),
        "driver_batch": lambda runs: driver_batch_start(copier, runs),
    }
    samples: dict[str, list[float]] = {name: [] for name in ways}
    started: dict[str, int] = dict.fromkeys(ways, 0)
    start_ms: dict[str, list[float]] = {name: [] for name in ways}
    start_cpu_ms: dict[str, list[float]] = {name: [] for name in ways}
    checked = 0
    for _ in range(args.rounds):
        for name, way in ways.items():
            if way is None:
                samples[name] += step_times(args.seconds, work)
                continue
            mover = Mover(way, parts, args.gap_ms / 1000)
            mover.start()
            samples[name] += step_times(args.seconds, work)
            mover.stop.set()
            mover.join()
            started[name] += mover.started_parts
            start_ms[name] += mover.start_ms
            start_cpu_ms[name] += mover.start_cpu_ms
            # The part's bytes, copied again into a zeroed pool, equal the cache's.
            torch.cuda.synchronize()
            pool[:] = b"\0" * len(pool)
            finish(way(parts[0]))
            for destination, source, nbytes in parts[0]:
                index = regions_index(regions, source)
                offset = source - regions[index].data_ptr()
                expected = bytes(regions[index][offset : offset + nbytes].cpu().numpy())
                if ctypes.string_at(destination, nbytes) != expected:
                    raise SystemExit(f"{name}: bytes differ in region {index}")
                checked += nbytes
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "runs_per_part": len(parts[0]),
                "part_bytes": sum(n for _, _, n in parts[0]),
                "rounds": args.rounds,
                "seconds_each": args.seconds,
                "gap_ms": args.gap_ms,
                "bytes_checked": checked,
                "step_ms": {
                    name: {
                        "steps": len(times),
                        "p50": round(statistics.median(times), 3),
                        "p90": round(statistics.quantiles(times, n=10)[-1], 3),
                        "parts_started": started[name],
                        "part_start_ms_p50": round(statistics.median(start_ms[name]), 3)
                        if start_ms[name]
                        else None,
                        "part_start_cpu_ms_p50": round(statistics.median(start_cpu_ms[name]), 3)
                        if start_cpu_ms[name]
                        else None,
                    }
                    for name, times in samples.items()
                },
            }
        )
    )


def regions_index(regions: list[torch.Tensor], address: int) -> int:
    return next(i for i, r in enumerate(regions) if r.data_ptr() <= address < r.data_ptr() + r.numel())


if __name__ == "__main__":
    main()
