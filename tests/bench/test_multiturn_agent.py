"""The agent workload: chat messages growing turn by turn, a tool call and its result between turns."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from kvferry.bench.multiturn_agent import (
    TOOLS,
    AgentConversation,
    ToolTiming,
    one_token_words,
    words_text,
)
from kvferry.bench.multiturn_driver import chat_request
from kvferry.bench.multiturn_stats import (
    RECOMPUTE,
    REUSE,
    TurnRecord,
    check_targets,
    reuse_hit_rate,
    summarize_buckets,
)
from kvferry.bench.multiturn_workload import WorkloadSpec, plan_conversations, seeded_rng

BENCH_MODEL = Path(__file__).resolve().parents[2] / "deploy" / "models" / "bench-qwen3"
WORDS = tuple(f"w{i:03d}" for i in range(64))


def _conversation(spec: WorkloadSpec, salt: str = "reuse", index: int = 0) -> AgentConversation:
    plan = plan_conversations(spec)[index]
    return AgentConversation(plan, seed=spec.seed, salt=salt, words=WORDS, tool_timing=ToolTiming(0.1, 0.5))


def _play(conversation: AgentConversation) -> list[list[dict[str, Any]]]:
    requests = []
    while not conversation.done:
        requests.append(list(conversation.messages()))
        conversation.add_reply(f"answer {conversation.next_turn}")
    return requests


SPEC = WorkloadSpec(conversations=2, turns=5, start_tokens=512, target_tokens=4096, reply_tokens=8)


def test_each_request_resends_the_whole_history() -> None:
    requests = _play(_conversation(SPEC))
    assert len(requests) == SPEC.turns
    for before, after in itertools.pairwise(requests):
        assert after[: len(before)] == before
        assert len(after) > len(before)
    assert [m["role"] for m in requests[0]] == ["system", "user"]


def test_every_answer_after_which_the_agent_goes_on_calls_a_tool_whose_result_follows() -> None:
    conversation = _conversation(SPEC)
    requests = _play(conversation)
    final = requests[-1]
    calls = [m for m in final if m["role"] == "assistant"]
    results = [m for m in final if m["role"] == "tool"]
    assert len(calls) == len(results) == SPEC.turns - 1
    for message in calls:
        (call,) = message["tool_calls"]
        assert message["content"].startswith("answer ")
        names = {tool["function"]["name"] for tool in TOOLS}
        assert call["type"] == "function" and call["function"]["name"] in names
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        # The call's result is the next tool message, naming its id.
        position = final.index(message)
        assert final[position + 1] == {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": final[position + 1]["content"],
        }
    assert len({m["tool_calls"][0]["id"] for m in calls}) == len(calls)
    # The last answer ends the conversation: no call, nothing pending.
    assert conversation.last_call is None and conversation.done
    with pytest.raises(IndexError):
        conversation.messages()


def test_tool_times_are_seeded_and_bounded() -> None:
    one, two = _conversation(SPEC), _conversation(SPEC)
    _play(one), _play(two)
    seconds = [c.seconds for c in one.tool_calls]
    assert seconds == [c.seconds for c in two.tool_calls]
    assert all(0.1 <= s <= 0.5 for s in seconds)
    with pytest.raises(ValueError, match="min <= max"):
        ToolTiming(2.0, 1.0).validate()
    with pytest.raises(ValueError, match="at most 60"):
        ToolTiming(0.0, 600.0).validate()


def test_same_seed_same_messages_other_salt_other_text_same_sizes() -> None:
    assert _play(_conversation(SPEC)) == _play(_conversation(SPEC))
    reuse, recompute = _play(_conversation(SPEC, "reuse")), _play(_conversation(SPEC, "recompute"))
    assert reuse[-1] != recompute[-1]
    sizes = [[len(str(m.get("content", "")).split()) for m in r] for r in (reuse[-1], recompute[-1])]
    assert sizes[0] == sizes[1]


def test_messages_hold_the_planned_tokens_in_one_token_words() -> None:
    plan = plan_conversations(SPEC)[0]
    first = _conversation(SPEC).messages()
    planned = [m.content_tokens for m in plan.turns[0].new_messages]
    assert [len(m["content"].split()) for m in first] == planned
    assert words_text(0, seeded_rng("x"), WORDS) != ""


def test_one_token_words_of_the_bench_tokenizer_are_one_token_each() -> None:
    words = one_token_words(BENCH_MODEL / "tokenizer.json")
    assert len(words) > 500 and list(words) == sorted(words)
    vocab = json.loads((BENCH_MODEL / "tokenizer.json").read_text())["model"]["vocab"]
    assert all("\u0120" + word in vocab for word in words)


def test_one_token_words_refuses_a_tokenizer_without_enough(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": {"\u0120the": 5, "x": 6}}}))
    with pytest.raises(ValueError, match="only 1 one-token words"):
        one_token_words(path)


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = json.dumps
    template = json.loads((BENCH_MODEL / "tokenizer_config.json").read_text())["chat_template"]
    return env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=True)


def test_the_bench_template_renders_tools_calls_and_results() -> None:
    conversation = _conversation(SPEC)
    conversation.messages()
    call = conversation.add_reply("thinking aloud")
    assert call is not None
    rendered = _render(conversation.messages(), list(TOOLS))
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.count("<|im_start|>system") == 1 and '"name": "search"' in rendered
    assert (
        f'<|im_start|>assistant\nthinking aloud\n<tool_call>\n{{"name": "{call.name}", "arguments": '
        in rendered
    )
    assert "<|im_start|>tool\n" in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_the_bench_template_renders_plain_chat_as_before() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert (
        _render(messages, None)
        == "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_request_streams_usage_and_declares_the_tools() -> None:
    body = chat_request("m", [{"role": "user", "content": "hi"}], 16)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["tools"] == list(TOOLS) and body["tool_choice"] == "none"
    assert body["max_tokens"] == 16 and body["ignore_eos"] is True


def _turn(mode: str, tokens: int, ttft: float, *, turn: int = 1, pulled: int = 0) -> TurnRecord:
    return TurnRecord(mode, 0, turn, tokens, ttft, ttft * 0.9, pulled, tokens - pulled)


def test_reuse_hit_rate_counts_turns_that_pulled_over_those_that_could() -> None:
    records = [
        _turn(REUSE, 2000, 300.0, turn=0),
        *(_turn(REUSE, 4000 + i, 200.0, turn=i + 1, pulled=3000) for i in range(3)),
        _turn(REUSE, 9000, 900.0, turn=4),
        _turn(RECOMPUTE, 9000, 1000.0, turn=4),
    ]
    check = reuse_hit_rate(summarize_buckets(records, 2048))
    assert check.value == pytest.approx(0.75) and check.met is False
    assert "3 of 4 turns pulled" in check.explanation
    checks = {c.name: c for c in check_targets(summarize_buckets(records[:4], 2048), [], ttl_seconds=None)}
    assert checks["reuse_hit_rate"].value == 1.0 and checks["reuse_hit_rate"].met is True
    assert reuse_hit_rate(summarize_buckets(records[:1], 2048)).met is None
