"""The workload generator: seeded, reproducible, growing from start to target, prompts extending."""

from __future__ import annotations

import itertools

import pytest
from kvferry.bench.multiturn_workload import (
    CONTENT_LOW,
    IM_START,
    ConversationTokens,
    WorkloadSpec,
    plan_conversations,
)


def _run(spec: WorkloadSpec, salt: str, index: int = 0) -> list[list[int]]:
    plan = plan_conversations(spec)[index]
    tokens = ConversationTokens(plan, seed=spec.seed, salt=salt, vocab_size=spec.vocab_size)
    prompts = []
    while not tokens.done:
        prompt = list(tokens.prompt())
        prompts.append(prompt)
        tokens.add_reply([CONTENT_LOW + i for i in range(spec.reply_tokens)])
    return prompts


def test_same_seed_same_plan_and_tokens() -> None:
    spec = WorkloadSpec(conversations=2, turns=6, target_tokens=8192, seed=7)
    assert plan_conversations(spec) == plan_conversations(spec)
    assert _run(spec, "reuse") == _run(spec, "reuse")


def test_other_seed_other_plan() -> None:
    one = plan_conversations(WorkloadSpec(seed=1))
    two = plan_conversations(WorkloadSpec(seed=2))
    assert [t.prompt_tokens for t in one[0].turns] != [t.prompt_tokens for t in two[0].turns]


def test_conversations_differ() -> None:
    plans = plan_conversations(WorkloadSpec(conversations=3))
    lengths = [tuple(t.prompt_tokens for t in p.turns) for p in plans]
    assert len(set(lengths)) == 3


def test_grows_from_start_to_target_monotonically() -> None:
    spec = WorkloadSpec(conversations=4, turns=12, start_tokens=2048, target_tokens=16384)
    for plan in plan_conversations(spec):
        lengths = [t.prompt_tokens for t in plan.turns]
        assert len(lengths) == spec.turns
        assert lengths[0] == spec.start_tokens
        assert lengths[-1] >= spec.target_tokens >= 16384
        assert all(b > a for a, b in itertools.pairwise(lengths))
        # Every turn adds at least the previous reply.
        assert all(b - a > spec.reply_tokens for a, b in itertools.pairwise(lengths))


def test_each_prompt_extends_the_previous_prompt_and_reply() -> None:
    spec = WorkloadSpec(conversations=1, turns=5, target_tokens=6000, reply_tokens=8)
    prompts = _run(spec, "reuse")
    plan = plan_conversations(spec)[0]
    reply = [CONTENT_LOW + i for i in range(spec.reply_tokens)]
    for turn, prompt in enumerate(prompts):
        assert len(prompt) == plan.turns[turn].prompt_tokens
        assert all(0 <= t < spec.vocab_size for t in prompt)
        if turn:
            previous = prompts[turn - 1]
            assert prompt[: len(previous) + len(reply)] == previous + reply
    assert prompts[0][0] == IM_START


def test_salt_changes_tokens_not_lengths() -> None:
    spec = WorkloadSpec(conversations=1, turns=4, target_tokens=5000)
    reuse, recompute = _run(spec, "reuse"), _run(spec, "recompute")
    assert [len(p) for p in reuse] == [len(p) for p in recompute]
    assert reuse[0] != recompute[0]


def test_short_reply_is_padded_so_lengths_stay_equal() -> None:
    spec = WorkloadSpec(conversations=1, turns=3, target_tokens=4096, reply_tokens=8)
    plan = plan_conversations(spec)[0]
    tokens = ConversationTokens(plan, seed=0, salt="x", vocab_size=spec.vocab_size)
    tokens.prompt()
    tokens.add_reply([CONTENT_LOW])
    assert len(tokens.prompt()) == plan.turns[1].prompt_tokens


def test_too_many_turns_past_the_end() -> None:
    spec = WorkloadSpec(conversations=1, turns=2, target_tokens=4096)
    tokens = ConversationTokens(plan_conversations(spec)[0], seed=0, salt="x", vocab_size=spec.vocab_size)
    for _ in range(2):
        tokens.prompt()
        tokens.add_reply([])
    assert tokens.done
    with pytest.raises(IndexError):
        tokens.prompt()


@pytest.mark.parametrize(
    "bad",
    [
        {"turns": 1},
        {"conversations": 0},
        {"target_tokens": 1000, "start_tokens": 2048},
        {"reply_tokens": 0},
        {"turns": 400, "target_tokens": 4096},
        {"jitter": 1.5},
    ],
)
def test_invalid_specs_are_refused(bad: dict[str, int | float]) -> None:
    with pytest.raises(ValueError, match="invalid workload"):
        WorkloadSpec(**bad).validate()  # type: ignore[arg-type]
