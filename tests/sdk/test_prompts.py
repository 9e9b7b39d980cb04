"""How a conversation builds each turn's prompt from its history (pure)."""

from __future__ import annotations

import pytest
from kvferry.sdk import ChatMessage, Reply, ReuseDecision, TurnSummary
from kvferry.sdk._conversation import append_reply, extend_prompt, normalize_prompt

SUMMARY = TurnSummary(
    prompt_tokens=1,
    completion_tokens=2,
    pulled_tokens=0,
    recomputed_tokens=1,
    ttft_ms=1.0,
    prefill_ms=1.0,
    reuse=ReuseDecision.NONE,
    prefill_engine_id="p",
    decode_engine_id="d",
    finish_reason="stop",
    turn=1,
)
REPLY = Reply(text="ok", token_ids=(7, 8), summary=SUMMARY)


def test_normalizes_every_prompt_form() -> None:
    assert normalize_prompt("hi") == "hi"
    assert normalize_prompt([1, 2, 3]) == (1, 2, 3)
    assert normalize_prompt(ChatMessage.user("hi")) == (ChatMessage("user", "hi"),)
    assert normalize_prompt({"role": "user", "content": "hi"}) == (ChatMessage("user", "hi"),)
    mixed_forms: list[ChatMessage | dict[str, str]] = [
        ChatMessage.system("s"),
        {"role": "user", "content": "u"},
    ]
    assert normalize_prompt(mixed_forms) == (
        ChatMessage("system", "s"),
        ChatMessage("user", "u"),
    )


@pytest.mark.parametrize("bad", ["", [], [1, ChatMessage.user("x")], [True, False]])
def test_rejects_empty_or_mixed_prompts(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        normalize_prompt(bad)  # type: ignore[arg-type]


def test_rejects_message_without_content() -> None:
    with pytest.raises(ValueError, match="content"):
        normalize_prompt({"role": "user"})


def test_history_grows_by_input_then_reply() -> None:
    chat = extend_prompt((ChatMessage.system("s"),), (ChatMessage.user("u"),))
    assert append_reply(chat, REPLY) == (
        ChatMessage.system("s"),
        ChatMessage.user("u"),
        ChatMessage.assistant("ok"),
    )
    # Token ids: exactly the ids the engine generated, so the next prompt extends the retained sequence.
    assert append_reply(extend_prompt((1, 2), (3,)), REPLY) == (1, 2, 3, 7, 8)
    assert append_reply(extend_prompt("Q: a\nA:", "\nQ: b\nA:"), REPLY) == "Q: a\nA:\nQ: b\nA:ok"


def test_history_kind_cannot_change() -> None:
    with pytest.raises(TypeError, match="chat messages"):
        extend_prompt((ChatMessage.user("u"),), "text")
