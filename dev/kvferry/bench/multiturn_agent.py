"""The agent workload of ``kvferry bench multiturn --workload agent``: pure, seeded, no engine needed.

The same conversation plan as the token workload
(:func:`~kvferry.bench.multiturn_workload.plan_conversations`: a system prompt and a user message,
then turns that each add a tool result and now and then a user message), sent as an agent sends it:
OpenAI chat messages through the router's ``/v1/chat/completions``, the whole history every turn,
with the tools declared. After each answer the agent calls a tool: the assistant message carries the
model's text and a ``tool_calls`` entry, the tool's result follows as a ``role: tool`` message with
that call's ``tool_call_id``, and the tool takes its time (seeded, bounded) before the next turn is
sent.

The tool calls are written by the client, not parsed from the model's output: the bench model has
dummy weights, so a well-formed call would need guided decoding (``tool_choice: "required"``), whose
grammar work would sit in every turn's TTFT. What the benchmark measures is the reuse of the resent
history, which holds the call either way: the model's text comes back as generated, then the call.

Text is made of words the model's tokenizer encodes as one token each (:func:`one_token_words`), so a
message of ``n`` planned tokens holds about ``n`` tokens; the prompt lengths reported are the router's
own counts (its ``/tokenize`` of the messages and tools).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvferry.bench.multiturn_workload import ConversationPlan, Message, seeded_rng

# The tools the agent declares (OpenAI function tools) and calls in turn.
TOOLS: tuple[dict[str, Any], ...] = tuple(
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string"}},
                "required": [argument],
            },
        },
    }
    for name, description, argument in (
        ("search", "Search the project's documents", "query"),
        ("read_file", "Read a file of the repository", "path"),
        ("run_tests", "Run the tests matching a pattern", "pattern"),
    )
)


@dataclass(frozen=True)
class ToolTiming:
    """How long each tool call takes (seconds, drawn uniformly per call)."""

    min_seconds: float = 0.2
    max_seconds: float = 1.0

    def validate(self) -> None:
        if not 0.0 <= self.min_seconds <= self.max_seconds:
            raise ValueError("tool time: need 0 <= min <= max seconds")
        if self.max_seconds > 60.0:
            raise ValueError("tool time: at most 60 s a call (the benchmark must stay bounded)")


def one_token_words(tokenizer_json: Path) -> tuple[str, ...]:
    """Lower-case words (3+ letters) that a byte-level BPE tokenizer holds as one space-led token, sorted."""
    vocab: Mapping[str, int] = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    words = sorted(
        token[1:]
        for token in vocab
        if token.startswith("\u0120") and len(token) > 3 and token[1:].isascii() and token[1:].isalpha()
        and token[1:].islower()
    )  # fmt: skip
    if len(words) < 16:
        raise ValueError(
            f"{tokenizer_json} has only {len(words)} one-token words; the agent workload needs 16"
        )
    return tuple(words)


def words_text(tokens: int, rng: random.Random, words: Sequence[str]) -> str:
    """About ``tokens`` tokens of text: that many one-token words."""
    return " ".join(rng.choice(words) for _ in range(max(1, tokens)))


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    seconds: float

    def message(self, content: str) -> dict[str, Any]:
        """The assistant message that makes this call after saying ``content``."""
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": self.id,
                    "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments},
                }
            ],
        }


class AgentConversation:
    """One conversation's chat messages, turn by turn, from its plan, the words and a salt.

    ``messages()`` is the request of the next turn (the whole history); ``add_reply(text)`` closes the
    turn with the model's answer and, unless it was the last turn, the tool call that follows it (its
    result opens the next turn). Replies must come in turn order.
    """

    def __init__(
        self,
        plan: ConversationPlan,
        *,
        seed: int,
        salt: str,
        words: Sequence[str],
        tool_timing: ToolTiming = ToolTiming(),
    ) -> None:
        tool_timing.validate()
        self.plan = plan
        self._rng = seeded_rng("agent", seed, salt, plan.index)
        self._words = words
        self._timing = tool_timing
        self._history: list[dict[str, Any]] = []
        self._next_turn = 0
        self._pending: list[dict[str, Any]] | None = None
        self._call: ToolCall | None = None
        self.tool_calls: list[ToolCall] = []

    @property
    def next_turn(self) -> int:
        return self._next_turn

    @property
    def done(self) -> bool:
        return self._next_turn >= len(self.plan.turns)

    @property
    def last_call(self) -> ToolCall | None:
        """The tool call the last answer made (None before the first answer and after the last)."""
        return self._call

    def messages(self) -> list[dict[str, Any]]:
        """The messages of the next turn (the same list until its reply is added)."""
        if self._pending is None:
            if self.done:
                raise IndexError(f"conversation {self.plan.index} has only {len(self.plan.turns)} turns")
            added = [self._message(m) for m in self.plan.turns[self._next_turn].new_messages]
            self._pending = self._history + added
        return self._pending

    def _message(self, planned: Message) -> dict[str, Any]:
        content = words_text(planned.content_tokens, self._rng, self._words)
        if planned.role != "tool":
            return {"role": planned.role, "content": content}
        if self._call is None:
            raise AssertionError(f"conversation {self.plan.index}: a tool result with no call before it")
        return {"role": "tool", "tool_call_id": self._call.id, "content": content}

    def add_reply(self, text: str) -> ToolCall | None:
        """Closes the current turn with the model's answer; returns the tool call the agent makes next."""
        history = self.messages()
        turn = self._next_turn
        self._next_turn += 1
        self._pending = None
        if self.done:
            self._call = None
            self._history = [*history, {"role": "assistant", "content": text}]
            return None
        tool = TOOLS[turn % len(TOOLS)]["function"]
        (argument,) = tool["parameters"]["required"]
        self._call = ToolCall(
            id=f"call_{self.plan.index}_{turn}_{self._rng.randrange(16**8):08x}",
            name=tool["name"],
            arguments=json.dumps({argument: words_text(6, self._rng, self._words)}),
            seconds=round(self._rng.uniform(self._timing.min_seconds, self._timing.max_seconds), 3),
        )
        self.tool_calls.append(self._call)
        self._history = [*history, self._call.message(text)]
        return self._call


__all__ = ["TOOLS", "AgentConversation", "ToolCall", "ToolTiming", "one_token_words", "words_text"]
