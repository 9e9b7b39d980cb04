"""The ``scale`` phase of ``kvferry bench registry``: many live retentions of realistic size.

Publishes ``--scale-retentions`` retentions whose sizes are drawn log-uniformly from
``--scale-tokens MIN,MAX`` (8k-128k tokens: 11-170 KB records), renews every one at TTL/3 through
``RenewRetentions`` batches for ``--scale-seconds``, then measures lookups. It reads etcd's own
metrics (WAL bytes written, database size and size in use) before, during and after, and the CPU
of each process, and projects what a million retentions would need from the per-item costs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

_METRICS = {
    "wal_bytes": "etcd_disk_wal_write_bytes_total",
    "db_bytes": "etcd_mvcc_db_total_size_in_bytes",
    "db_in_use_bytes": "etcd_mvcc_db_total_size_in_use_in_bytes",
}
PROJECTED_RETENTIONS = 1_000_000


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scale-retentions", type=int, default=10_000, help="live retentions the scale phase holds"
    )
    parser.add_argument(
        "--scale-tokens",
        default="8192,131072",
        help="MIN,MAX tokens per retention (log-uniform) in the scale phase",
    )
    parser.add_argument(
        "--scale-ttl", type=int, default=300, help="retention TTL in the scale phase, seconds"
    )
    parser.add_argument("--scale-seconds", type=float, default=60.0, help="how long the scale phase renews")
    parser.add_argument("--scale-batch", type=int, default=500, help="conversations per RenewRetentions call")
    parser.add_argument("--scale-callers", type=int, default=4, help="concurrent RenewRetentions calls")
    parser.add_argument(
        "--scale-lookups", type=float, default=5.0, help="seconds of closed-loop lookups at the end"
    )


async def etcd_metrics(endpoint: str) -> dict[str, float]:
    """etcd's own counters and gauges this phase reports (from its /metrics)."""
    import httpx

    url = endpoint if endpoint.startswith("http") else f"http://{endpoint}"
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics", timeout=10)).text
    found: dict[str, float] = {}
    for name, metric in _METRICS.items():
        match = re.search(rf"^{metric} (\S+)$", text, re.MULTILINE)
        if match is not None:
            found[name] = float(match.group(1))
    return found


def _sizes(count: int, low: int, high: int, block_size: int) -> list[int]:
    chooser = random.Random(17)
    tokens = [round(math.exp(chooser.uniform(math.log(low), math.log(high)))) for _ in range(count)]
    return [max(block_size, value - value % block_size) for value in tokens]


async def scale(
    workload: Any, args: argparse.Namespace, cpu: Any, etcd_endpoint: str, percentile: Callable[..., float]
) -> dict[str, Any]:
    from kvferry.pd.digest import block_digests
    from kvferry.v1 import registry_service_pb2 as api
    from kvferry.v1 import resources_pb2 as resources

    count, ttl = args.scale_retentions, args.scale_ttl
    low, high = (int(part) for part in args.scale_tokens.split(","))
    block_size = workload.block_size
    sizes = _sizes(count, low, high, block_size)
    # Chained digests: a shorter record's digests are the longest one's prefix.
    digests = block_digests(list(range(high)), block_size)
    names = [f"scale-{index}" for index in range(count)]
    metrics = bool(etcd_endpoint)
    before = await etcd_metrics(etcd_endpoint) if metrics else {}

    # Published in the order renewals come round, so none waits longer than TTL/3 for its first.
    queue = collections.deque(range(count))
    publish_errors = 0

    async def publisher(worker: int) -> None:
        nonlocal publish_errors
        while queue:
            index = queue.popleft()
            blocks = sizes[index] // block_size
            retention = resources.Retention(
                tenant=workload.tenant,
                conversation_id=names[index],
                engine_id=workload.engine_id,
                engine_request_id=f"r-{names[index]}",
                block_ids=range(1000, 1000 + blocks),
                num_tokens=sizes[index],
                block_digests=digests[:blocks],
                turn=1,
                ttl_seconds=ttl,
            )
            try:
                await workload.stub(worker).PublishRetention(
                    api.PublishRetentionRequest(retention=retention), timeout=30
                )
            except Exception:
                publish_errors += 1

    publish_cpu: dict[str, float] = {}
    started = time.monotonic()
    with cpu.measure(publish_cpu):
        await asyncio.gather(*(publisher(worker) for worker in range(32)))
    publish_seconds = time.monotonic() - started
    if publish_seconds > ttl / 3:
        print(
            f"scale: publishing took {publish_seconds:.0f}s, over TTL/3: the first ones may expire",
            flush=True,
        )
    loaded = await etcd_metrics(etcd_endpoint) if metrics else {}
    print(
        f"scale: published {count} in {publish_seconds:.0f}s ({publish_errors} errors); etcd {loaded}",
        flush=True,
    )

    # Renewals: every retention every TTL/3, in RenewRetentions batches spread evenly over the period.
    period = ttl / 3
    batch = max(1, args.scale_batch)
    batches = [names[start : start + batch] for start in range(0, count, batch)]
    loop = asyncio.get_running_loop()
    end = loop.time() + args.scale_seconds
    due: asyncio.Queue[tuple[float, list[str]]] = asyncio.Queue(maxsize=args.scale_callers * 2)
    lateness: list[float] = []
    renewed = 0
    renew_errors = 0
    error_kinds: collections.Counter[str] = collections.Counter()
    samples: list[dict[str, float]] = []

    async def scheduler() -> None:
        base = loop.time()
        round_number = 0
        while True:
            for index, conversations in enumerate(batches):
                when = base + round_number * period + index * period / len(batches)
                if when >= end:
                    return
                if (delay := when - loop.time()) > 0:
                    await asyncio.sleep(delay)
                await due.put((when, conversations))
            round_number += 1

    async def caller(worker: int) -> None:
        nonlocal renewed, renew_errors
        while True:
            when, conversations = await due.get()
            lateness.append(loop.time() - when)
            request = api.RenewRetentionsRequest(
                renewals=[
                    api.RenewRetentionRequest(tenant=workload.tenant, conversation_id=name)
                    for name in conversations
                ]
            )
            try:
                response = await workload.stub(worker).RenewRetentions(request, timeout=30)
                failed = [renewal for renewal in response.renewals if renewal.code]
                renewed += len(conversations) - len(failed)
                renew_errors += len(failed)
                for renewal in failed:
                    error_kinds[f"code {renewal.code}: {renewal.message[:80]}"] += 1
            except Exception as error:
                renew_errors += len(conversations)
                error_kinds[f"call: {str(error)[:120]}"] += len(conversations)
            finally:
                due.task_done()

    async def sampler() -> None:
        while True:
            await asyncio.sleep(10)
            samples.append({"t": loop.time() - renew_started, **await etcd_metrics(etcd_endpoint)})

    renew_cpu: dict[str, float] = {}
    renew_started = loop.time()
    renew_before = await etcd_metrics(etcd_endpoint) if metrics else {}
    with cpu.measure(renew_cpu):
        tasks = [asyncio.create_task(caller(worker)) for worker in range(args.scale_callers)]
        if metrics:
            tasks.append(asyncio.create_task(sampler()))
        await scheduler()
        await due.join()
        for task in tasks:
            task.cancel()
    renew_seconds = loop.time() - renew_started
    renew_after = await etcd_metrics(etcd_endpoint) if metrics else {}

    # Lookups of random live retentions: closed loop, 16 clients.
    latencies: list[float] = []
    misses = 0
    lookup_end = loop.time() + args.scale_lookups
    chooser = random.Random(5)

    async def looker(client: int) -> None:
        nonlocal misses
        while loop.time() < lookup_end:
            request = api.GetRetentionRequest(tenant=workload.tenant, conversation_id=chooser.choice(names))
            sent = time.perf_counter()
            try:
                await workload.stub(client).GetRetention(request, timeout=10)
            except Exception:
                misses += 1  # expired (renewals fell behind) or failed: not a latency sample
                continue
            latencies.append(time.perf_counter() - sent)

    await asyncio.gather(*(looker(client) for client in range(16)))
    ordered_lookups, ordered_lateness = sorted(latencies), sorted(lateness)
    index = await _index_figures(workload, names, args.paced_rate, args.scale_lookups)

    rate = renewed / renew_seconds
    wal_per_second = (renew_after.get("wal_bytes", 0) - renew_before.get("wal_bytes", 0)) / renew_seconds
    db_per_retention = (loaded.get("db_in_use_bytes", 0) - before.get("db_in_use_bytes", 0)) / count
    cpu_per_renewal = {
        name: usage / rate
        for name, usage in renew_cpu.items()
        if name in ("registry", "etcd", "bench") and rate
    }
    needed_rate = PROJECTED_RETENTIONS / period
    result = {
        "retentions": count,
        "tokens_min_median_max": [min(sizes), sorted(sizes)[count // 2], max(sizes)],
        "record_bytes_mean": sum(sizes) / count / block_size * 21,
        "publish_seconds": publish_seconds,
        "publish_rate": count / publish_seconds,
        "publish_errors": publish_errors,
        "publish_cpu": publish_cpu,
        "renew_seconds": renew_seconds,
        "renew_batch": batch,
        "required_renew_rate": count / period,
        "achieved_renew_rate": rate,
        "renew_errors": renew_errors,
        "renew_error_kinds": dict(error_kinds.most_common(5)),
        "renew_lateness_p99_s": percentile(ordered_lateness, 0.99),
        "renew_cpu": renew_cpu,
        "cpu_seconds_per_renewal": cpu_per_renewal,
        "etcd_wal_bytes_per_second": wal_per_second,
        "etcd_wal_bytes_per_renewal": wal_per_second / rate if rate else float("nan"),
        "etcd_db_bytes_before_loaded_end": [
            before.get("db_bytes"),
            loaded.get("db_bytes"),
            renew_after.get("db_bytes"),
        ],
        "etcd_db_in_use_bytes_per_retention": db_per_retention,
        "etcd_over_time": samples,
        "lookups": len(latencies),
        "lookup_misses": misses,
        "lookup_p50_ms": percentile(ordered_lookups, 0.5) * 1e3,
        "lookup_p99_ms": percentile(ordered_lookups, 0.99) * 1e3,
        "router_index": index,
        "router_index_rate": args.paced_rate,
        "projection": {
            "retentions": PROJECTED_RETENTIONS,
            "renewals_per_second": needed_rate,
            "cpu_cores": {name: per * needed_rate for name, per in cpu_per_renewal.items()},
            "etcd_wal_bytes_per_second": needed_rate * (wal_per_second / rate if rate else float("nan")),
            "etcd_db_bytes": PROJECTED_RETENTIONS * db_per_retention,
            "router_index_bytes": PROJECTED_RETENTIONS * index["bytes_per_retention"],
        },
    }
    return result


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.asynccontextmanager
async def router_index(workload: Any) -> AsyncIterator[tuple[Any, float]]:
    """A router's retention index fed by WatchAllRetentions from the bench's registry, synced, and the
    turn's lookup over it (``RetentionLookups``); yields the lookups and the seconds the sync took."""
    from kvferry.router.registry_client import GrpcRegistry
    from kvferry.router.retention_index import RetentionIndex, RetentionLookups

    client = GrpcRegistry(workload.channel(0), timeout_seconds=60)
    index = RetentionIndex(client.watch_all_retentions)
    started = time.monotonic()
    task = asyncio.create_task(index.run())
    try:
        await asyncio.wait_for(index.ready.wait(), 600)
        yield RetentionLookups(client, index), time.monotonic() - started
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def paced_index_lookups(
    lookups: Any, tenant: str, names: list[str], rate: float, seconds: float
) -> dict[str, Any]:
    """Lookups at ``rate`` per second for ``seconds``, each as a turn makes it (``RetentionLookups.lookup``:
    the index, the registry when it cannot answer); the time of each call, and where it was answered."""
    loop = asyncio.get_running_loop()
    chooser = random.Random(9)
    samples: list[float] = []
    paths: collections.Counter[str] = collections.Counter()
    start = loop.time() + 0.05
    for number in range(int(rate * seconds)):
        if (delay := start + number / rate - loop.time()) > 0:
            await asyncio.sleep(delay)
        name = chooser.choice(names)
        sent = time.perf_counter_ns()
        found = await lookups.lookup(tenant, name)
        samples.append((time.perf_counter_ns() - sent) / 1e6)
        paths[found.path if found.retention is not None else f"{found.path}/none"] += 1
    elapsed = loop.time() - start
    samples.sort()
    return {
        "target_rate": rate,
        "achieved_rate": len(samples) / elapsed,
        "lookups": len(samples),
        "paths": dict(paths),
        "p50_ms": samples[len(samples) // 2],
        "p99_ms": samples[int(len(samples) * 0.99)],
        "max_ms": samples[-1],
    }


def paced_index_line(result: dict[str, Any]) -> str:
    return (
        f"paced lookups as a turn makes them (router index): target={result['target_rate']:.0f}/s "
        f"achieved={result['achieved_rate']:.0f}/s p50={result['p50_ms'] * 1e3:.1f}us "
        f"p99={result['p99_ms'] * 1e3:.1f}us max={result['max_ms'] * 1e3:.1f}us answered by {result['paths']}"
    )


async def _index_figures(workload: Any, names: list[str], rate: float, seconds: float) -> dict[str, Any]:
    """A router's retention index fed by WatchAllRetentions: time to sync, memory per retention
    (resident-set growth of this process), and the turn's lookup latency over it at ``rate``/s."""
    gc.collect()
    before = _rss_bytes()
    async with router_index(workload) as (lookups, sync_seconds):
        gc.collect()
        grown = _rss_bytes() - before
        entries = len(lookups.index)
        paced = await paced_index_lookups(lookups, workload.tenant, names, rate, seconds)
    return {
        "entries": entries,
        "sync_seconds": sync_seconds,
        "bytes_per_retention": grown / max(1, entries),
        "lookup_p50_ms": paced["p50_ms"],
        "lookup_p99_ms": paced["p99_ms"],
        "lookup_paths": paced["paths"],
    }


def scale_line(result: dict[str, Any]) -> str:
    projection, index = result["projection"], result["router_index"]
    cores = " ".join(f"{name}={value:.2f}" for name, value in projection["cpu_cores"].items())
    return (
        f"scale: {result['retentions']} live (tokens {result['tokens_min_median_max']}), published at "
        f"{result['publish_rate']:.0f}/s; renewals needed {result['required_renew_rate']:.0f}/s, reached "
        f"{result['achieved_renew_rate']:.0f}/s in batches of {result['renew_batch']} (errors "
        f"{result['renew_errors']} {result['renew_error_kinds'] or ''}, "
        f"lateness p99 {result['renew_lateness_p99_s']:.2f}s); etcd WAL "
        f"{result['etcd_wal_bytes_per_second'] / 1e3:.1f} KB/s = "
        f"{result['etcd_wal_bytes_per_renewal']:.0f} B/renewal; "
        f"etcd DB before/loaded/end {result['etcd_db_bytes_before_loaded_end']} "
        f"({result['etcd_db_in_use_bytes_per_retention'] / 1e3:.1f} KB in use per retention); lookups "
        f"p50 {result['lookup_p50_ms']:.2f} ms p99 {result['lookup_p99_ms']:.2f} ms "
        f"({result['lookup_misses']} missed); "
        f"cpu {result['renew_cpu']}\n"
        f"router index: {index['entries']} synced in {index['sync_seconds']:.1f}s, "
        f"{index['bytes_per_retention'] / 1e3:.1f} KB per retention, lookups as a turn makes them at "
        f"{result['router_index_rate']:.0f}/s p50 {index['lookup_p50_ms'] * 1e3:.1f} us p99 "
        f"{index['lookup_p99_ms'] * 1e3:.1f} us (answered by {index['lookup_paths']})\n"
        f"projection to {projection['retentions']:,} (renewals at TTL/3: "
        f"{projection['renewals_per_second']:.0f}/s): cpu cores {cores}; etcd WAL "
        f"{projection['etcd_wal_bytes_per_second'] / 1e6:.1f} MB/s; "
        f"etcd DB {projection['etcd_db_bytes'] / 1e9:.1f} GB; router index "
        f"{projection['router_index_bytes'] / 1e9:.1f} GB per replica"
    )
