"""Every setting of ``kvferry up``: one table, each a flag, an environment variable and a config key.

A value comes from the first of: the command line, the environment, the TOML file (``--config``), the
default. ``kvferry up --print-config`` prints the effective values with where each came from.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.connector.settings import KvferrySettings
from kvferry.runtime.flags import EnvFlags


def state_home() -> Path:
    """``$KVFERRY_HOME``, else ``$XDG_STATE_HOME/kvferry``, else ``~/.local/state/kvferry``: absolute, so
    ``kvferry down`` and ``kvferry status`` find the stack from any directory."""
    explicit = os.environ.get("KVFERRY_HOME")
    if explicit:
        return Path(explicit).expanduser().resolve()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return (Path(base).expanduser() / "kvferry").resolve()


def add_workdir_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir",
        type=lambda text: Path(text).expanduser().resolve(),
        default=state_home(),
        help="the stack's state directory: etcd data, logs, stack.json, env (default: $KVFERRY_HOME, "
        "else $XDG_STATE_HOME/kvferry, else ~/.local/state/kvferry; now %(default)s)",
    )


def boolean(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no); anything else is an error, not False."""
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    try:
        return words[text.strip().lower()]
    except KeyError:
        raise ValueError(f"not a boolean: {text!r} (true or false)") from None


def share(text: str) -> float:
    """A share of a GPU's memory, above 0 and at most 1; 0 lets the stack choose."""
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(f"must be between 0 and 1, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be at least 1, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port; 0 lets the stack pick a free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"must be a TCP port (0 to 65535; 0: a free one), got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A size or length; 0 lets the stack choose."""
    value = int(text)
    if value < 0:
        raise ValueError(f"must be 0 (the stack chooses) or more, got {value}")
    return value


@dataclass(frozen=True)
class Setting:
    section: str
    key: str
    flag: str
    env: str
    kind: Callable[[str], Any]
    default: Any
    help: str
    # A boolean given as the bare flag means true (``--gpu``); ``--gpu false`` still says false.
    switch: bool = False

    @property
    def name(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def dest(self) -> str:
        return f"setting_{self.section}_{self.key}"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "etcd",
        "endpoints",
        "--etcd-endpoints",
        "KVFERRY_ETCD_ENDPOINTS",
        str,
        "",
        "use this etcd (host:port[,...]) instead of starting one",
    ),
    Setting(
        "etcd",
        "client_port",
        "--etcd-client-port",
        "KVFERRY_ETCD_CLIENT_PORT",
        port,
        0,
        "loopback port of the etcd kvferry up starts, for its clients (the registry); 0: a free port "
        "(kept across etcd's restarts)",
    ),
    Setting(
        "etcd",
        "peer_port",
        "--etcd-peer-port",
        "KVFERRY_ETCD_PEER_PORT",
        port,
        0,
        "loopback port of the etcd kvferry up starts, for its peers (a one-member cluster listens on it "
        "all the same); 0: a free port",
    ),
    Setting(
        "registry",
        "address",
        "--registry-address",
        "KVFERRY_REGISTRY_ADDRESS",
        str,
        "",
        "use this registry (host:port) instead of starting one",
    ),
    Setting(
        "registry",
        "listen",
        "--registry-listen",
        "KVFERRY_REGISTRY_LISTEN",
        str,
        "",
        "host:port the registry kvferry up starts listens on (default: a free loopback port; set it for "
        "external engines' sidecars to find the registry at a fixed address)",
    ),
    Setting(
        "engines",
        "external",
        "--external-engines",
        "KVFERRY_EXTERNAL_ENGINES",
        boolean,
        False,
        "engines and sidecars already run and register themselves (true/false)",
    ),
    Setting(
        "engines",
        "prefill",
        "--prefill-engines",
        "KVFERRY_PREFILL_ENGINES",
        positive_int,
        1,
        "prefill engines to start (ids prefill-0, prefill-1, ...), each on a CPU core of its own (with "
        "--gpu: round-robin over the GPUs)",
    ),
    Setting(
        "engines",
        "decode",
        "--decode-engines",
        "KVFERRY_DECODE_ENGINES",
        positive_int,
        1,
        "decode engines to start (ids decode-0, decode-1, ...), each on a CPU core of its own (with "
        "--gpu: round-robin over the GPUs)",
    ),
    Setting(
        "engines",
        "share_cores",
        "--share-cores",
        "KVFERRY_SHARE_CORES",
        boolean,
        False,
        "let vllm-cpu engines share CPU cores when there are fewer usable cores than engines (engines on "
        "one core slow each other's turns); without it kvferry up refuses to start them",
        switch=True,
    ),
    Setting(
        "engines",
        "model_dir",
        "--model-dir",
        "KVFERRY_MODEL_DIR",
        str,
        "",
        "model directory of the engines (default: the repo's test model, .models/tiny-qwen3: Qwen3's "
        "tokenizer, seeded random weights; with --gpu a Qwen3-8B-shaped one, vLLM's dummy weights, written "
        "to the state directory)",
    ),
    Setting(
        "engines",
        "gpu",
        "--gpu",
        "KVFERRY_GPU",
        boolean,
        False,
        "CUDA vLLM engines (Qwen3-8B shape, dummy weights) on the GPUs present instead of vllm-cpu, "
        "round-robin: one prefill and one decode engine both on GPU 0 with one GPU, on GPUs 0 and 1 "
        "otherwise; the router prices pulls with the qwen3-8b profile",
        switch=True,
    ),
    Setting(
        "engines",
        "gpu_memory_utilization",
        "--gpu-memory-utilization",
        "KVFERRY_GPU_MEMORY_UTILIZATION",
        share,
        0.0,
        "each GPU engine's share of its GPU; 0: 0.85 for an engine alone on its GPU, else 0.9 split "
        "among the engines sharing it (0.45 each for two)",
    ),
    Setting(
        "engines",
        "kv_cache_gib",
        "--kv-cache-gib",
        "KVFERRY_KV_CACHE_GIB",
        non_negative_int,
        0,
        "each engine's KV cache in GiB: vllm-cpu's VLLM_CPU_KVCACHE_SPACE, with --gpu vLLM's "
        "--kv-cache-memory-bytes (then --gpu-memory-utilization no longer sizes it); 0: 1 GiB on "
        "vllm-cpu, what --gpu-memory-utilization leaves on a GPU",
    ),
    Setting(
        "engines",
        "max_model_len",
        "--max-model-len",
        "KVFERRY_MAX_MODEL_LEN",
        non_negative_int,
        0,
        "longest sequence (prompt + output tokens) an engine takes, vLLM's --max-model-len; the "
        "router refuses longer turns with a 400; 0: 8192 for the test model, 40960 with --gpu",
    ),
    Setting(
        "engines",
        "host_pool_blocks",
        "--host-pool-blocks",
        "KVFERRY_HOST_POOL_BLOCKS",
        non_negative_int,
        0,
        "decode engines' host tier: slots of host memory (one KV block each) where retentions idle past "
        "--demote-after-seconds, or over the KV cache's retention budget, move out of the KV cache and are "
        "pulled from (docs/connector.md#host-tier); 0: none",
    ),
    Setting(
        "engines",
        "demote_after_seconds",
        "--demote-after-seconds",
        "KVFERRY_DEMOTE_AFTER_SECONDS",
        non_negative_int,
        60,
        "with --host-pool-blocks: seconds after its turn finished a held retention moves to the host pool",
    ),
    Setting(
        "engines",
        "demote_blocks_per_step",
        "--demote-blocks-per-step",
        "KVFERRY_DEMOTE_BLOCKS_PER_STEP",
        positive_int,
        KvferrySettings.demote_blocks_per_step,
        "with --host-pool-blocks: blocks a decode engine copies into its pool per step that runs requests (a "
        "longer move goes in parts, one a step)",
    ),
    Setting(
        "engines",
        "connector_module",
        "--connector-module",
        "KVFERRY_CONNECTOR_MODULE",
        str,
        "kvferry.connector.connector",
        "module vLLM loads KvferryConnector from (vLLM 0.25: vllm_pull_proof_connector, with tools/gpu on "
        "PYTHONPATH; see docs/calibration.md)",
    ),
    Setting(
        "router",
        "grpc_listen",
        "--grpc-listen",
        "KVFERRY_ROUTER_GRPC_LISTEN",
        str,
        "127.0.0.1:50052",
        "router gRPC host:port",
    ),
    Setting(
        "router",
        "http_listen",
        "--http-listen",
        "KVFERRY_ROUTER_HTTP_LISTEN",
        str,
        "127.0.0.1:8080",
        "router HTTP host:port",
    ),
    Setting(
        "router",
        "api_keys",
        "--api-keys",
        "KVFERRY_API_KEYS",
        str,
        "kvferry-demo-key=demo",
        "tenants and their keys, KEY=TENANT[,KEY=TENANT...]; the demo and the env file use the first",
    ),
    Setting(
        "metrics",
        "base_port",
        "--metrics-port",
        "KVFERRY_STACK_METRICS_PORT",
        int,
        0,
        "serve Prometheus /metrics from every service on loopback from this port up (registry, router, "
        "then one per sidecar) and write prometheus.yml beside the logs; 0: off",
    ),
    Setting(
        "retention",
        "ttl_seconds",
        "--retention-ttl",
        "KVFERRY_RETENTION_TTL",
        positive_int,
        60,
        "seconds a retained conversation lives without renewal: the lease the connectors ask for "
        "and the registry's default",
    ),
)


@dataclass(frozen=True)
class StackConfig:
    etcd_endpoints: str = ""
    etcd_client_port: int = 0
    etcd_peer_port: int = 0
    registry_address: str = ""
    registry_listen: str = ""
    external_engines: bool = False
    prefill_engines: int = 1
    decode_engines: int = 1
    share_cores: bool = False
    model_dir: str = ""
    gpu: bool = False
    gpu_memory_utilization: float = 0.0
    kv_cache_gib: int = 0
    max_model_len: int = 0
    host_pool_blocks: int = 0
    demote_after_seconds: int = 60
    demote_blocks_per_step: int = KvferrySettings.demote_blocks_per_step
    connector_module: str = "kvferry.connector.connector"
    grpc_listen: str = "127.0.0.1:50052"
    http_listen: str = "127.0.0.1:8080"
    api_keys: str = "kvferry-demo-key=demo"
    retention_ttl_seconds: int = 60
    metrics_base_port: int = 0
    # Where each value came from (flag, env NAME, config FILE, default), by setting name.
    sources: Mapping[str, str] | None = None

    @property
    def api_key(self) -> str:
        return self.tenant_keys[0][0]

    @property
    def tenant(self) -> str:
        return self.tenant_keys[0][1]

    @property
    def tenant_keys(self) -> list[tuple[str, str]]:
        pairs = []
        for item in self.api_keys.split(","):
            key, _, tenant = item.strip().partition("=")
            pairs.append((key.strip(), tenant.strip()))
        return pairs


_FIELDS = {
    "etcd.endpoints": "etcd_endpoints",
    "etcd.client_port": "etcd_client_port",
    "etcd.peer_port": "etcd_peer_port",
    "registry.address": "registry_address",
    "registry.listen": "registry_listen",
    "engines.external": "external_engines",
    "engines.prefill": "prefill_engines",
    "engines.decode": "decode_engines",
    "engines.share_cores": "share_cores",
    "engines.model_dir": "model_dir",
    "engines.gpu": "gpu",
    "engines.gpu_memory_utilization": "gpu_memory_utilization",
    "engines.kv_cache_gib": "kv_cache_gib",
    "engines.max_model_len": "max_model_len",
    "engines.host_pool_blocks": "host_pool_blocks",
    "engines.demote_after_seconds": "demote_after_seconds",
    "engines.demote_blocks_per_step": "demote_blocks_per_step",
    "engines.connector_module": "connector_module",
    "router.grpc_listen": "grpc_listen",
    "router.http_listen": "http_listen",
    "router.api_keys": "api_keys",
    "retention.ttl_seconds": "retention_ttl_seconds",
    "metrics.base_port": "metrics_base_port",
}


def add_setting_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="TOML file with any of the settings below ([section] key = value)",
    )
    flags = EnvFlags(parser, environ).group("settings (flag > environment > --config file > default)")
    for setting in SETTINGS:
        flags.add(
            setting.flag,
            setting.env,
            f"{setting.help}; config key {setting.name}; default {setting.default!r}",
            type=setting.kind,
            switch=setting.switch,
        )


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> StackConfig:
    """The effective configuration from parsed flags (with the environment folded in) and ``--config``."""
    env = os.environ if environ is None else environ
    path: Path | None = args.config
    raw: dict[str, Any] = tomllib.loads(path.read_text()) if path is not None else {}
    known_sections = {s.section for s in SETTINGS}
    unknown = set(raw) - known_sections
    if unknown:
        raise ValueError(
            f"{path}: unknown sections {sorted(unknown)}; expected {', '.join(sorted(known_sections))}"
        )
    for section, table in raw.items():
        known = {s.key for s in SETTINGS if s.section == section}
        extra = set(table) - known
        if extra:
            raise ValueError(
                f"{path}: unknown keys in [{section}]: {sorted(extra)}; expected {sorted(known)}"
            )
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        attribute = setting.flag.lstrip("-").replace("-", "_")
        given = getattr(args, attribute, None)
        if given is not None:
            values[setting.name] = given
            # EnvFlags folds the variable into the flag's default; equal to it: it came from there.
            from_env = bool(env.get(setting.env)) and given == setting.kind(env[setting.env])
            sources[setting.name] = f"env {setting.env}" if from_env else "flag"
        elif setting.key in raw.get(setting.section, {}):
            value = raw[setting.section][setting.key]
            try:
                values[setting.name] = setting.kind(
                    str(value).lower() if isinstance(value, bool) else str(value)
                )
            except ValueError as problem:
                raise ValueError(f"{path}: {setting.name} = {value!r}: {problem}") from None
            sources[setting.name] = f"config {path}"
        else:
            values[setting.name] = setting.default
            sources[setting.name] = "default"
    config = StackConfig(**{_FIELDS[name]: value for name, value in values.items()}, sources=sources)
    if config.registry_address and config.registry_listen:
        raise ValueError(
            "registry.address (use a running registry) and registry.listen (where to start one) exclude "
            "each other: set one"
        )
    if config.etcd_endpoints and (config.etcd_client_port or config.etcd_peer_port):
        raise ValueError(
            "etcd.endpoints (use a running etcd) and etcd.client_port / etcd.peer_port (the ports of the "
            "etcd kvferry up starts) exclude each other: set one"
        )
    if config.etcd_client_port and config.etcd_client_port == config.etcd_peer_port:
        raise ValueError(
            f"etcd.client_port and etcd.peer_port are both {config.etcd_client_port}: set two ports"
        )
    for key, tenant in config.tenant_keys:
        if not key or not tenant:
            raise ValueError(f"router.api_keys: {config.api_keys!r} is not KEY=TENANT[,KEY=TENANT...]")
    return config


def setting_flags(config: StackConfig) -> list[str]:
    """Every setting of ``config`` as its flag: a child ``kvferry up`` gets exactly these values (flags
    win over its environment and any config file)."""
    flags: list[str] = []
    for setting in SETTINGS:
        value = getattr(config, _FIELDS[setting.name])
        flags += [setting.flag, ("true" if value else "false") if isinstance(value, bool) else str(value)]
    return flags


def render(config: StackConfig) -> str:
    """The effective configuration as TOML (loadable with ``--config``), each value's source beside it."""
    lines: list[str] = []
    section = ""
    sources = config.sources or {}
    for setting in SETTINGS:
        if setting.section != section:
            section = setting.section
            lines.append(f"{'' if not lines else chr(10)}[{section}]")
        value = getattr(config, _FIELDS[setting.name])
        literal = (
            ("true" if value else "false")
            if isinstance(value, bool)
            else (str(value) if isinstance(value, int | float) else f'"{value}"')
        )
        lines.append(
            f"{setting.key} = {literal}  # {sources.get(setting.name, 'default')}; env {setting.env}"
        )
    return "\n".join(lines)
