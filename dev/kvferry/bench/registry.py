"""``kvferry bench registry``: registry throughput, latency and live-retention capacity on a real etcd.

Phases (``--phases``):

- ``throughput``: publish, lookup and renew, each for ``--seconds`` at every client count in
  ``--clients`` (closed loop: each client sends its next call when the last one answered);
  ops/s and p50/p99 latency.
- ``paced``: lookups at a fixed ``--paced-rate`` (open loop) for ``--paced-seconds``; p50/p99/max
  measured from each call's scheduled start, so a stalled client shows up as latency. Then the same
  rate of lookups as a turn makes them: through a router's retention index (fed by
  ``WatchAllRetentions``), each call timed.
- ``hold``: publishes ``--hold-retentions`` retentions with ``--hold-ttl`` and renews each one
  every TTL/3 for ``--hold-seconds``; reports how many are still live at the end, the renewal
  rate it needed and reached, and how late renewals ran.
- ``scale`` (not in the default set): many live retentions of realistic size renewed in
  ``RenewRetentions`` batches, with etcd's own byte counters and a projection to a million
  (``kvferry.bench.registry_scale``).

With no ``--registry`` it starts its own etcd (unless ``--etcd-endpoints``) and a registry
subprocess, and reports the CPU each process used per phase (evidence of what limits).
Latencies include the Python gRPC client on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from kvferry.bench import registry_scale
from kvferry.stack.readiness import grpc_serving

PHASES = ("throughput", "paced", "hold")
OPTIONAL_PHASES = ("scale",)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--registry", default="", help="address of a running registry; empty: start one")
    parser.add_argument(
        "--etcd-endpoints",
        default="",
        help="etcd for the registry this bench starts; empty: start an etcd too",
    )
    parser.add_argument(
        "--registry-process",
        choices=["subprocess", "inprocess"],
        default="subprocess",
        help="run the started registry in its own process (realistic) or in this one",
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated subset of {PHASES + OPTIONAL_PHASES}",
    )
    parser.add_argument("--clients", default="1,16,64", help="concurrent clients for the throughput phase")
    parser.add_argument(
        "--ops", default="publish,lookup,renew", help="operations the throughput phase measures"
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="duration of each throughput measurement")
    parser.add_argument(
        "--conversations", type=int, default=2000, help="conversations lookups and renewals use"
    )
    parser.add_argument("--num-tokens", type=int, default=512, help="tokens per retention (sets record size)")
    parser.add_argument(
        "--etcd-history",
        type=int,
        default=600,
        help="the started registry's --etcd-history: seconds of etcd history kept (each renewal's revision "
        "stays that long; the DB levels off past it)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block of the bench engine")
    parser.add_argument(
        "--paced-rate", type=float, default=1000.0, help="lookups per second in the paced phase"
    )
    parser.add_argument("--paced-seconds", type=float, default=8.0, help="duration of one paced run")
    parser.add_argument(
        "--paced-repeats", type=int, default=3, help="paced runs (the median p99 is reported)"
    )
    parser.add_argument(
        "--hold-retentions", type=int, default=20_000, help="retentions the hold phase keeps live"
    )
    parser.add_argument("--hold-ttl", type=int, default=60, help="retention TTL in the hold phase, seconds")
    parser.add_argument("--hold-seconds", type=float, default=75.0, help="how long the hold phase renews")
    parser.add_argument("--hold-workers", type=int, default=64, help="concurrent renewals in the hold phase")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels the clients spread over")
    parser.add_argument("--json", default="", help="also write the results to this file")
    registry_scale.configure(parser)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_main_until_signalled(args))


async def _main_until_signalled(args: argparse.Namespace) -> int:
    """Runs the bench; SIGTERM or SIGINT stops it and still stops the etcd and registry it started."""
    main = asyncio.current_task()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, main.cancel if main else (lambda: None))
    try:
        return await _main(args)
    except asyncio.CancelledError:
        print("bench interrupted; what it started is stopped", file=sys.stderr)
        return 130


# --- measurement --------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile, ``fraction`` in [0, 1]; NaN when empty."""
    if not sorted_values:
        return float("nan")
    return float(np.percentile(sorted_values, fraction * 100, method="nearest"))


@dataclass
class Summary:
    name: str
    clients: int
    ops: int
    errors: int
    seconds: float
    ops_per_second: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        cpu = " ".join(f"{k}={v:.0%}" for k, v in self.cpu.items())
        return (
            f"{self.name:<10} clients={self.clients:<3} ops/s={self.ops_per_second:8.0f} "
            f"p50={self.p50_ms:6.2f}ms p99={self.p99_ms:6.2f}ms max={self.max_ms:7.2f}ms "
            f"errors={self.errors} cpu[{cpu}]"
        )


def summarize(name: str, clients: int, latencies: list[float], errors: int, seconds: float) -> Summary:
    ordered = sorted(latencies)
    return Summary(
        name=name,
        clients=clients,
        ops=len(ordered),
        errors=errors,
        seconds=seconds,
        ops_per_second=len(ordered) / seconds if seconds else 0.0,
        p50_ms=percentile(ordered, 0.50) * 1e3,
        p99_ms=percentile(ordered, 0.99) * 1e3,
        max_ms=(ordered[-1] if ordered else float("nan")) * 1e3,
    )


class CpuMeter:
    """CPU seconds used by this process and by the processes the bench started, per wall second."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids

    def _sample(self) -> dict[str, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        sample = {"bench": usage.ru_utime + usage.ru_stime}
        try:
            # Linux PSI: time some runnable task waited for a CPU (the machine is shared).
            some = Path("/proc/pressure/cpu").read_text().splitlines()[0]
            sample["cpu_wait"] = int(some.rsplit("total=", 1)[1]) / 1e6
        except (OSError, IndexError, ValueError):
            pass
        for name, pid in self._pids.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                times = psutil.Process(pid).cpu_times()
                sample[name] = times.user + times.system
        return sample

    @contextmanager
    def measure(self, into: dict[str, float]) -> Iterator[None]:
        before, started = self._sample(), time.monotonic()
        yield
        after, elapsed = self._sample(), time.monotonic() - started
        for name, value in after.items():
            into[name] = (value - before.get(name, value)) / elapsed if elapsed else 0.0


# --- the system under test ----------------------------------------------------------------------


@dataclass
class Deployment:
    address: str
    etcd_endpoint: str
    key_prefix: str
    pids: dict[str, int]
    cleanup: list[Callable[[], Awaitable[None]]]

    async def close(self) -> None:
        for step in reversed(self.cleanup):
            await step()


async def deploy(args: argparse.Namespace) -> Deployment:
    from kvferry.stack.etcd_process import EtcdProcess, free_port

    cleanup: list[Callable[[], Awaitable[None]]] = []
    pids: dict[str, int] = {}
    if args.registry:
        return Deployment(args.registry, args.etcd_endpoints, "", pids, cleanup)
    endpoint = args.etcd_endpoints
    if not endpoint:
        work = Path(tempfile.mkdtemp(prefix="kvferry-bench-etcd-"))
        etcd = EtcdProcess(data_dir=work / "data", log_path=work / "etcd.log")
        await asyncio.to_thread(etcd.start)
        cleanup.append(lambda: asyncio.to_thread(shutil.rmtree, work, True))
        cleanup.append(lambda: asyncio.to_thread(etcd.stop))
        endpoint = etcd.endpoint
        if etcd.pid:
            pids["etcd"] = etcd.pid
    prefix = f"/kvferry-bench-{os.getpid()}-{int(time.time())}/"
    ttl_flags = [
        "--max-engine-ttl",
        "600",
        "--max-retention-ttl",
        "3600",
        "--etcd-history",
        str(args.etcd_history),
    ]
    if args.registry_process == "inprocess":
        from kvferry.registry.config import RegistryConfig, TtlPolicy
        from kvferry.registry.server import create_registry

        running = await create_registry(
            RegistryConfig(
                listen_address="127.0.0.1:0",
                etcd_endpoints=(endpoint,),
                key_prefix=prefix,
                ttl=TtlPolicy(max_engine_ttl_seconds=600, max_retention_ttl_seconds=3600),
                history_seconds=args.etcd_history,
                log_level="warning",
            )
        )
        cleanup.append(running.stop)
        return Deployment(running.address, endpoint, prefix, pids, cleanup)
    port = free_port()
    command = [
        "-m", "kvferry.cli.main", "registry", "--listen", f"127.0.0.1:{port}", "--etcd-endpoints", endpoint,
        "--key-prefix", prefix, "--log-level", "warning", *ttl_flags,
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(sys.executable, *command, start_new_session=True)

    async def stop_registry() -> None:
        process.terminate()
        await asyncio.wait_for(process.wait(), 10)

    cleanup.append(stop_registry)
    pids["registry"] = process.pid
    address = f"127.0.0.1:{port}"
    await grpc_serving("registry", address, 30.0)
    return Deployment(address, endpoint, prefix, pids, cleanup)


# --- workload -----------------------------------------------------------------------------------


class Workload:
    """Stubs over a few channels, one bench engine kept alive, and retention messages to send."""

    def __init__(self, address: str, channels: int, num_tokens: int, block_size: int) -> None:
        import grpc
        from kvferry.pd.digest import block_digests
        from kvferry.v1 import registry_service_pb2_grpc as registry_grpc

        self._channels = [grpc.aio.insecure_channel(address) for _ in range(max(1, channels))]
        self.stubs = [registry_grpc.RegistryServiceStub(channel) for channel in self._channels]
        self.engine_id = f"bench-engine-{os.getpid()}"
        self.tenant = "bench"
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.digests = block_digests(list(range(num_tokens)), block_size)
        self.block_ids = list(range(1000, 1000 + -(-num_tokens // block_size)))
        self._heartbeat: asyncio.Task[None] | None = None

    def stub(self, client: int) -> Any:
        return self.stubs[client % len(self.stubs)]

    def channel(self, client: int) -> Any:
        return self._channels[client % len(self._channels)]

    async def start(self) -> None:
        from kvferry.v1 import registry_service_pb2 as api
        from kvferry.v1 import resources_pb2 as resources

        engine = resources.Engine(
            engine_id=self.engine_id,
            role=resources.ENGINE_ROLE_DECODE,
            http_endpoint="http://127.0.0.1:1",
            block_size=self.block_size,
            model="bench",
            kv_compatibility_hash="bench",
        )
        await self.stubs[0].RegisterEngine(
            api.RegisterEngineRequest(engine=engine, ttl_seconds=30), timeout=10
        )

        async def beat() -> None:
            while True:
                await asyncio.sleep(5)
                try:
                    request = api.HeartbeatEngineRequest(engine_id=self.engine_id)
                    await self.stubs[0].HeartbeatEngine(request, timeout=10)
                except Exception as error:
                    print(f"heartbeat failed: {error}", file=sys.stderr)

        self._heartbeat = asyncio.create_task(beat())

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for channel in self._channels:
            await channel.close()

    def retention(self, conversation_id: str, turn: int, ttl_seconds: int) -> Any:
        from kvferry.v1 import resources_pb2 as resources

        return resources.Retention(
            tenant=self.tenant,
            conversation_id=conversation_id,
            engine_id=self.engine_id,
            engine_request_id=f"r-{conversation_id}-{turn}",
            block_ids=self.block_ids,
            num_tokens=self.num_tokens,
            block_digests=self.digests,
            turn=turn,
            ttl_seconds=ttl_seconds,
        )

    async def publish(self, client: int, conversation_id: str, turn: int, ttl_seconds: int) -> None:
        from kvferry.v1 import registry_service_pb2 as api

        request = api.PublishRetentionRequest(retention=self.retention(conversation_id, turn, ttl_seconds))
        await self.stub(client).PublishRetention(request, timeout=10)

    async def lookup(self, client: int, conversation_id: str) -> None:
        from kvferry.v1 import registry_service_pb2 as api

        request = api.GetRetentionRequest(tenant=self.tenant, conversation_id=conversation_id)
        await self.stub(client).GetRetention(request, timeout=10)

    async def renew(self, client: int, conversation_id: str) -> None:
        from kvferry.v1 import registry_service_pb2 as api

        request = api.RenewRetentionRequest(tenant=self.tenant, conversation_id=conversation_id)
        await self.stub(client).RenewRetention(request, timeout=10)


async def closed_loop(
    name: str, clients: int, seconds: float, operation: Callable[[int, int], Awaitable[None]], cpu: CpuMeter
) -> Summary:
    latencies: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds

    async def client(index: int) -> None:
        nonlocal errors
        sequence = 0
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                await operation(index, sequence)
                latencies.append(time.perf_counter() - started)
            except Exception:
                errors += 1
            sequence += 1

    usage: dict[str, float] = {}
    started = time.monotonic()
    with cpu.measure(usage):
        await asyncio.gather(*(client(index) for index in range(clients)))
    summary = summarize(name, clients, latencies, errors, time.monotonic() - started)
    summary.cpu = usage
    return summary


async def paced(
    operation: Callable[[int], Awaitable[None]], rate: float, seconds: float, cpu: CpuMeter
) -> dict[str, Any]:
    """Calls ``operation`` at a fixed rate whatever its latency (open loop)."""
    total = int(rate * seconds)
    from_schedule: list[float] = []
    service: list[float] = []
    errors = 0
    in_flight: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()

    async def one(index: int, scheduled: float) -> None:
        nonlocal errors
        sent = loop.time()
        try:
            await operation(index)
        except Exception:
            errors += 1
            return
        done = loop.time()
        from_schedule.append(done - scheduled)
        service.append(done - sent)

    usage: dict[str, float] = {}
    start = loop.time() + 0.1
    with cpu.measure(usage):
        for index in range(total):
            scheduled = start + index / rate
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(index, scheduled))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        await asyncio.gather(*in_flight)
    elapsed = loop.time() - start
    ordered, ordered_service = sorted(from_schedule), sorted(service)
    return {
        "target_rate": rate,
        "achieved_rate": len(ordered) / elapsed,
        "lookups": len(ordered),
        "errors": errors,
        "p50_ms": percentile(ordered, 0.5) * 1e3,
        "p90_ms": percentile(ordered, 0.9) * 1e3,
        "p99_ms": percentile(ordered, 0.99) * 1e3,
        "p999_ms": percentile(ordered, 0.999) * 1e3,
        "max_ms": ordered[-1] * 1e3 if ordered else float("nan"),
        "service_p99_ms": percentile(ordered_service, 0.99) * 1e3,
        "cpu": usage,
    }


async def hold(
    workload: Workload, args: argparse.Namespace, cpu: CpuMeter, deployment: Deployment
) -> dict[str, Any]:
    count, ttl, workers = args.hold_retentions, args.hold_ttl, args.hold_workers
    names = [f"hold-{index}" for index in range(count)]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(count):
        queue.put_nowait(index)
    publish_errors = 0

    async def publisher(worker: int) -> None:
        nonlocal publish_errors
        while not queue.empty():
            index = queue.get_nowait()
            try:
                await workload.publish(worker, names[index], 1, ttl)
            except Exception:
                publish_errors += 1
            if index and index % 10_000 == 0:
                print(f"hold: {index} published after {time.monotonic() - started:.0f}s", flush=True)

    publish_usage: dict[str, float] = {}
    started = time.monotonic()
    with cpu.measure(publish_usage):
        await asyncio.gather(*(publisher(worker) for worker in range(workers)))
    publish_seconds = time.monotonic() - started
    loaded_at = time.monotonic()

    # Renew each retention every TTL/3, spread evenly, until the hold time is up.
    period = ttl / 3
    required_rate = count / period
    lateness: list[float] = []
    renew_errors = 0
    renewals = 0
    due: asyncio.Queue[tuple[float, int]] = asyncio.Queue(maxsize=workers * 4)
    loop = asyncio.get_running_loop()
    end = loop.time() + args.hold_seconds

    async def scheduler() -> None:
        base = loop.time()
        round_number = 0
        while True:
            for index in range(count):
                when = base + round_number * period + index * period / count
                if when >= end:
                    return
                delay = when - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await due.put((when, index))
            round_number += 1

    async def renewer(worker: int) -> None:
        nonlocal renew_errors, renewals
        while True:
            when, index = await due.get()
            lateness.append(loop.time() - when)
            try:
                await workload.renew(worker, names[index])
                renewals += 1
            except Exception:
                renew_errors += 1
            finally:
                due.task_done()

    renew_usage: dict[str, float] = {}
    renew_started = loop.time()
    with cpu.measure(renew_usage):
        tasks = [asyncio.create_task(renewer(worker)) for worker in range(workers)]
        await scheduler()
        await due.join()
        for task in tasks:
            task.cancel()
    renew_seconds = loop.time() - renew_started
    live = await _count_live(deployment, workload, names)
    ordered = sorted(lateness)
    return {
        "retentions": count,
        "ttl_seconds": ttl,
        "publish_seconds": publish_seconds,
        "publish_rate": count / publish_seconds,
        "publish_errors": publish_errors,
        "publish_cpu": publish_usage,
        "hold_seconds": time.monotonic() - loaded_at,
        "renew_period_seconds": period,
        "required_renew_rate": required_rate,
        "achieved_renew_rate": renewals / renew_seconds,
        "renew_errors": renew_errors,
        "renew_lateness_p50_s": percentile(ordered, 0.5),
        "renew_lateness_p99_s": percentile(ordered, 0.99),
        "renew_lateness_max_s": ordered[-1] if ordered else float("nan"),
        "live_at_end": live,
        "renew_cpu": renew_usage,
    }


async def _count_live(deployment: Deployment, workload: Workload, names: list[str]) -> int:
    """Live retentions of the hold phase: counted in etcd when the bench owns it, else sampled."""
    if deployment.key_prefix and deployment.etcd_endpoint:
        from kvferry.registry.etcd import EtcdGateway, EtcdSettings, prefix_end

        gateway = EtcdGateway(EtcdSettings(endpoints=(deployment.etcd_endpoint,), timeout_seconds=30))
        await gateway.connect()
        try:
            prefix = f"{deployment.key_prefix}retention/live/{workload.tenant}/hold-".encode()
            response = await gateway.range(prefix, prefix_end(prefix), keys_only=True)
            return int(response.count)
        finally:
            await gateway.close()
    sample = random.sample(names, min(1000, len(names)))
    found = 0
    for name in sample:
        try:
            await workload.lookup(0, name)
            found += 1
        except Exception:
            continue
    return round(found / len(sample) * len(names))


def _paced_line(title: str, paced_result: dict[str, Any]) -> str:
    cpu = " ".join(f"{name}={value:.0%}" for name, value in paced_result["cpu"].items())
    return (
        f"{title}: target={paced_result['target_rate']:.0f}/s achieved={paced_result['achieved_rate']:.0f}/s "
        f"p50={paced_result['p50_ms']:.2f}ms p90={paced_result['p90_ms']:.2f}ms "
        f"p99={paced_result['p99_ms']:.2f}ms p99.9={paced_result['p999_ms']:.2f}ms "
        f"max={paced_result['max_ms']:.2f}ms errors={paced_result['errors']} cpu[{cpu}]"
    )


async def _paced_etcd_floor(
    deployment: Deployment, conversations: list[str], args: argparse.Namespace, cpu: CpuMeter
) -> dict[str, Any]:
    from kvferry.registry.etcd import EtcdGateway, EtcdSettings

    gateway = EtcdGateway(EtcdSettings(endpoints=(deployment.etcd_endpoint,)))
    await gateway.connect()
    keys = [f"{deployment.key_prefix}retention/live/bench/{name}".encode() for name in conversations]

    async def read(index: int) -> None:
        await gateway.range(random.choice(keys))

    try:
        return await paced(read, args.paced_rate, args.paced_seconds, cpu)
    finally:
        await gateway.close()


async def _main(args: argparse.Namespace) -> int:
    phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    unknown = set(phases) - set(PHASES + OPTIONAL_PHASES)
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}; choose from {PHASES + OPTIONAL_PHASES}")
    levels = [int(level) for level in args.clients.split(",")]
    deployment = await deploy(args)
    cpu = CpuMeter(deployment.pids)
    workload = Workload(deployment.address, args.channels, args.num_tokens, args.block_size)
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs (shared), Python {sys.version.split()[0]}",
        "registry": deployment.address,
        "record": {"num_tokens": args.num_tokens, "blocks": len(workload.block_ids)},
    }
    etcd_text = deployment.etcd_endpoint or "(external)"
    print(f"registry {deployment.address}; etcd {etcd_text}; {results['machine']}")
    try:
        await workload.start()
        gc.collect()
        gc.freeze()  # long-lived objects out of full collections: fewer client-side pauses
        conversations = [f"conv-{index}" for index in range(args.conversations)]
        # Every lookup and renewal needs a live retention: publish the pool first.
        seed_queue = list(conversations)

        async def seed(client: int) -> None:
            while seed_queue:
                await workload.publish(client, seed_queue.pop(), 1, 3600)

        await asyncio.gather(*(seed(client) for client in range(64)))

        if "throughput" in phases:
            summaries: list[Summary] = []
            next_turn: dict[str, int] = {}

            async def publish_op(client: int, sequence: int) -> None:
                # Each client owns its conversations, so turns rise without conflicts.
                name = f"pub-{client}-{sequence % 8}"
                turn = next_turn.get(name, 0) + 1
                next_turn[name] = turn
                await workload.publish(client, name, turn, 600)

            async def lookup_op(client: int, sequence: int) -> None:
                await workload.lookup(client, random.choice(conversations))

            async def renew_op(client: int, sequence: int) -> None:
                await workload.renew(client, random.choice(conversations))

            operations = {"publish": publish_op, "lookup": lookup_op, "renew": renew_op}
            for name in [op.strip() for op in args.ops.split(",") if op.strip()]:
                operation = operations[name]
                for clients in levels:
                    summary = await closed_loop(name, clients, args.seconds, operation, cpu)
                    summaries.append(summary)
                    print(summary.line(), flush=True)
            results["throughput"] = [asdict(summary) for summary in summaries]

        if "paced" in phases:

            async def paced_lookup(index: int) -> None:
                await workload.lookup(index, random.choice(conversations))

            floor = bool(deployment.etcd_endpoint and deployment.key_prefix)
            runs: list[dict[str, Any]] = []
            floors: list[dict[str, Any]] = []
            for _ in range(args.paced_repeats):
                runs.append(await paced(paced_lookup, args.paced_rate, args.paced_seconds, cpu))
                print(_paced_line("paced lookups via the registry", runs[-1]), flush=True)
                if floor:
                    # The floor: the same reads straight from this process to etcd, no registry between.
                    floors.append(await _paced_etcd_floor(deployment, conversations, args, cpu))
                    print(_paced_line("paced reads straight to etcd  ", floors[-1]), flush=True)
            results["paced"] = runs
            results["paced_etcd_floor"] = floors
            p99s = sorted(run["p99_ms"] for run in runs)
            print(f"paced lookup p99 over {len(runs)} runs: median {p99s[len(p99s) // 2]:.2f} ms, all {p99s}")
            # The same lookups as a turn makes them: the router's retention index, fed by WatchAllRetentions.
            async with registry_scale.router_index(workload) as (lookups, _):
                index_runs = []
                for _ in range(args.paced_repeats):
                    index_runs.append(
                        await registry_scale.paced_index_lookups(
                            lookups, workload.tenant, conversations, args.paced_rate, args.paced_seconds
                        )
                    )
                    print(registry_scale.paced_index_line(index_runs[-1]), flush=True)
            results["paced_index"] = index_runs
            index_p99s = sorted(round(run["p99_ms"], 4) for run in index_runs)
            print(
                f"paced lookup p99 through the router index over {len(index_runs)} runs: median "
                f"{index_p99s[len(index_p99s) // 2]:.4f} ms, all {index_p99s}"
            )

        if "hold" in phases:
            held = await hold(workload, args, cpu, deployment)
            results["hold"] = held
            print(
                f"hold: published {held['retentions']} in {held['publish_seconds']:.1f}s "
                f"({held['publish_rate']:.0f}/s, errors {held['publish_errors']}); renewing every "
                f"{held['renew_period_seconds']:.0f}s for {held['hold_seconds']:.0f}s needs "
                f"{held['required_renew_rate']:.0f}/s, reached {held['achieved_renew_rate']:.0f}/s "
                f"(errors {held['renew_errors']}, lateness p99 {held['renew_lateness_p99_s']:.2f}s "
                f"max {held['renew_lateness_max_s']:.2f}s); "
                f"live at end {held['live_at_end']}/{held['retentions']}; "
                f"cpu {held['renew_cpu']}",
                flush=True,
            )
        if "scale" in phases:
            scaled = await registry_scale.scale(workload, args, cpu, deployment.etcd_endpoint, percentile)
            results["scale"] = scaled
            print(registry_scale.scale_line(scaled), flush=True)
    finally:
        await workload.close()
        await deployment.close()
    if args.json:
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(results, indent=2))
    return 0
