"""One fault run: multi-turn conversations through the router while faults are injected, then the
oracle. Shared by ``tests/faults`` (a CI-sized run) and ``kvferry bench faults`` (the figures).

Turns run on a :class:`~kvferry.testing.loop_thread.LoopThread`; faults are injected from the calling
thread, one after another in a shuffled order until every kind was injected ``faults_per_kind``
times, while the turns go on. Then every fault is healed, the turns stop, the retentions' leases run
out and their grace passes, and the oracle reads the logs.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvferry.router.http_api import CONVERSATION_HEADER
from kvferry.testing.fault_stack import API_KEY, FaultKind, FaultStack, StackSettings
from kvferry.testing.loop_thread import LoopThread
from kvferry.testing.oracle import OracleReport, check
from kvferry.testing.processes import wait_until
from kvferry.testing.standin_engine import standin_tokenize
from kvferry.testing.standins import MODEL


@dataclass
class TurnCounts:
    sent: int = 0
    answered: int = 0
    failed: int = 0
    # Answered turns that reused retained KV (pulled tokens) / that could have and recomputed.
    reused: int = 0
    recomputed: int = 0
    refused_concurrent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


@dataclass
class FaultRunResult:
    turns: TurnCounts
    faults: dict[str, int]
    oracle: OracleReport
    held_blocks_at_end: int | None
    seconds: float
    # Fault kinds that failed to inject or heal at least once, with the first error.
    inject_errors: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "turns": vars(self.turns),
            "faults": self.faults,
            "faults_total": sum(self.faults.values()),
            "inject_errors": self.inject_errors,
            "fenced": self.oracle.fenced_pulls,
            "served_after_freed": self.oracle.served_after_freed,
            "leaked_blocks": self.oracle.leaked_blocks,
            "held_blocks_at_end": self.held_blocks_at_end,
            "oracle": self.oracle.summary(),
            "violations": self.oracle.violations(),
        }


class Conversations:
    """Multi-turn conversations through the router's HTTP API (token prompts), counted. Odd-numbered
    conversations name themselves in the ``X-Conversation-Id`` header (the router asks for the turn's mark
    before it reads the body), even ones in the body's ``conversation_id``."""

    def __init__(self, router_url: str, count: int, seed: int = 13) -> None:
        self.router_url = router_url
        self.counts = TurnCounts()
        self._rng = random.Random(seed)
        self._histories: dict[str, list[int]] = {f"conv-{i}": [] for i in range(count)}
        self._named_in_header = {f"conv-{i}" for i in range(count) if i % 2}
        self._busy: set[str] = set()
        self._client = httpx.AsyncClient(timeout=20, headers={"authorization": f"Bearer {API_KEY}"})

    async def close(self) -> None:
        await self._client.aclose()

    def _user_tokens(self) -> list[int]:
        return [self._rng.randrange(40, 120) for _ in range(self._rng.randrange(8, 40))]

    async def turn(self, conversation: str, *, concurrent: bool = False) -> None:
        """One turn, retried as an agent would while the stack recovers (connection errors, 409, 5xx,
        and 404 while the router knows no engine of the model yet), for about 6 s."""
        history = self._histories[conversation]
        prompt = history + self._user_tokens()
        self.counts.sent += 1
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
        headers = {}
        if conversation in self._named_in_header:
            headers[CONVERSATION_HEADER] = conversation
        else:
            body["conversation_id"] = conversation
        for attempt in range(6):
            try:
                response = await self._client.post(
                    f"{self.router_url}/v1/completions", json=body, headers=headers
                )
                status = str(response.status_code)
            except httpx.HTTPError as error:
                response, status = None, type(error).__name__
            self.counts.statuses[status] = self.counts.statuses.get(status, 0) + 1
            if response is not None and response.status_code == 200:
                answer = response.json()
                usage = answer["usage"]
                self.counts.answered += 1
                if usage.get("pulled_tokens", 0) > 0:
                    self.counts.reused += 1
                elif history:
                    self.counts.recomputed += 1
                if not concurrent:
                    self._histories[conversation] = prompt + standin_tokenize(answer["choices"][0]["text"])
                return
            if response is not None and response.status_code == 409:
                self.counts.refused_concurrent += 1
                if concurrent:
                    return  # the other turn of the pair runs: this one was refused, as it should be
            await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
        self.counts.failed += 1

    async def run(
        self,
        stop: threading.Event,
        concurrency: int,
        max_turns: int,
        paced: threading.Event,
        pace_seconds: float,
    ) -> None:
        """Turns from ``concurrency`` workers until ``max_turns`` were sent or ``stop``; while ``paced``
        is set each worker waits ``pace_seconds`` between turns (the turns then span the faults)."""

        async def worker() -> None:
            while not stop.is_set() and self.counts.sent < max_turns:
                if paced.is_set():
                    await asyncio.sleep(self._rng.uniform(0, 2 * pace_seconds))
                idle = [c for c in self._histories if c not in self._busy]
                conversation = self._rng.choice(idle)
                self._busy.add(conversation)
                try:
                    await self.turn(conversation)
                finally:
                    self._busy.discard(conversation)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def concurrent_pair(self) -> None:
        """Two turns of one conversation at once (a retry racing its original)."""
        idle = [c for c in self._histories if c not in self._busy and self._histories[c]]
        if not idle:
            return
        conversation = self._rng.choice(idle)
        self._busy.add(conversation)
        try:
            await asyncio.gather(
                self.turn(conversation, concurrent=True), self.turn(conversation, concurrent=True)
            )
        finally:
            self._busy.discard(conversation)


def run_faults(
    settings: StackSettings,
    *,
    turns: int,
    faults_per_kind: int,
    kinds: Sequence[FaultKind] = tuple(FaultKind),
    conversations: int = 12,
    concurrency: int = 3,
    seed: int = 13,
    progress: Callable[[str], None] | None = None,
    progress_every_seconds: float = 10.0,
) -> FaultRunResult:
    """``progress``: told what the run is doing (its phases, and while faults are injected, at most every
    ``progress_every_seconds``, the faults and turns so far)."""
    started = time.monotonic()
    say = progress or (lambda line: None)
    with LoopThread("kvferry-faults") as loop:
        stack = FaultStack(settings, loop)
        try:
            say("starting etcd (3 members), registry replicas, sidecars, router and stand-in engines")
            stack.start()
            say(f"stack up in {time.monotonic() - started:.0f} s")
            talk = Conversations(stack.router_url, conversations, seed)
            stop, paced = threading.Event(), threading.Event()
            schedule = [kind for kind in kinds for _ in range(faults_per_kind)]
            random.Random(seed).shuffle(schedule)
            # Spread most turns over the faults (a fault takes about hold + 1 s), the rest after them.
            expected_seconds = len(schedule) * (settings.hold_seconds + 1.0)
            if schedule:
                paced.set()
            pace = concurrency * expected_seconds / max(1, int(turns * 0.8))
            load = asyncio.run_coroutine_threadsafe(
                talk.run(stop, concurrency, turns, paced, pace), loop.loop
            )
            inject_errors: dict[str, str] = {}
            told = time.monotonic()
            for done, kind in enumerate(schedule, 1):
                try:
                    stack.inject(kind, on_concurrent=lambda: loop.run(talk.concurrent_pair()))
                except (TimeoutError, OSError, subprocess.SubprocessError, RuntimeError) as error:
                    # A fault that could not be injected or healed (e.g. no etcd leader in time) is
                    # counted and everything healed; the run goes on.
                    inject_errors.setdefault(kind.value, f"{type(error).__name__}: {error}")
                    stack.injected[kind.value] -= 1
                    stack.heal_all()
                time.sleep(0.2)
                if time.monotonic() - told >= progress_every_seconds or done == len(schedule):
                    told = time.monotonic()
                    counts = talk.counts
                    say(
                        f"faults {done}/{len(schedule)} injected; turns {counts.sent}/{turns} sent, "
                        f"{counts.answered} answered, {counts.failed} failed; {told - started:.0f} s"
                    )
            paced.clear()
            stack.heal_all()
            stack.wait_ready()
            say(f"faults healed; the remaining {max(0, turns - talk.counts.sent)} turns run without faults")
            # The rest of the turns run without faults; then the load stops.
            while not load.done() and talk.counts.sent < turns:
                time.sleep(0.2)
            stop.set()
            load.result(timeout=120)
            loop.run(talk.close())
            limit = _drain_limit(settings)
            say(f"turns done; waiting for D to free every retained block (at most {limit:.0f} s)")
            held = _drain(stack)
            say("checking the engines' logs (the oracle)")
            oracle = check([stack.logs / "decode.log"], [stack.logs / "prefill.log"], held)
            return FaultRunResult(
                turns=talk.counts,
                faults=dict(stack.injected),
                oracle=oracle,
                held_blocks_at_end=held,
                seconds=time.monotonic() - started,
                inject_errors=inject_errors,
            )
        finally:
            stack.stop()


def _drain(stack: FaultStack) -> int | None:
    """Waits until D holds no block (every retention's lease ran out and its grace passed, or the hard
    cap), at most lease + grace + hard cap; returns what D still holds then."""
    try:
        wait_until(
            lambda: stack.held_blocks() == 0,
            _drain_limit(stack.settings),
            "D freeing every retained block",
            interval=0.5,
        )
    except TimeoutError:
        pass
    return stack.held_blocks()


def _drain_limit(settings: StackSettings) -> float:
    return settings.retention_ttl_seconds + settings.hard_cap_seconds + 3 * settings.grace_seconds + 10
