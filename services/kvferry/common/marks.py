"""The one typed definition of what kvferry adds to vLLM's ``kv_transfer_params``.

The router marks every decode request under the single key ``"kvferry"``; the connector reads the
mark when the request finishes. A :class:`ConversationMark` retains the request's blocks for the
conversation; a :class:`ReleaseMark` (a turn nothing will reuse) frees them at once, where vLLM's
bidirectional mode would hold every decode's blocks for ``decoder_kv_blocks_ttl``. Requests without
the key behave exactly as in plain vLLM.

Wire forms (JSON, inside ``kv_transfer_params``)::

    "kvferry": {"tenant": "acme", "conversation_id": "c-42", "turn": 3}
    "kvferry": {"retain": false}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MARK_KEY = "kvferry"
RETAIN_KEY = "retain"


@dataclass(frozen=True)
class ConversationMark:
    tenant: str
    conversation_id: str
    turn: int

    def to_params(self) -> dict[str, Any]:
        return {MARK_KEY: {"tenant": self.tenant, "conversation_id": self.conversation_id, "turn": self.turn}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> ConversationMark | None:
        """The conversation mark in ``params``, or None (absent, or a :class:`ReleaseMark`).
        A malformed mark raises ValueError."""
        mark = parse_mark(params)
        return mark if isinstance(mark, ConversationMark) else None


@dataclass(frozen=True)
class ReleaseMark:
    """Free the decode's blocks when it finishes: nothing will reuse this turn."""

    def to_params(self) -> dict[str, Any]:
        return {MARK_KEY: {RETAIN_KEY: False}}


Mark = ConversationMark | ReleaseMark


def parse_mark(params: Mapping[str, Any] | None) -> Mark | None:
    """The mark in ``params``, or None when absent. A malformed mark raises ValueError."""
    if not params or MARK_KEY not in params:
        return None
    raw = params[MARK_KEY]
    if not isinstance(raw, Mapping):
        raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] must be an object, got {type(raw).__name__}")
    if RETAIN_KEY in raw:
        if raw[RETAIN_KEY] is not False:
            raise ValueError(f"kv_transfer_params[{MARK_KEY!r}][{RETAIN_KEY!r}] may only be false: {raw!r}")
        return ReleaseMark()
    return _conversation_mark(raw)


def _conversation_mark(raw: Mapping[str, Any]) -> ConversationMark:
    try:
        tenant, conversation_id, turn = raw["tenant"], raw["conversation_id"], raw["turn"]
    except KeyError as missing:
        raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] lacks {missing}") from None
    if not isinstance(tenant, str) or not isinstance(conversation_id, str) or not isinstance(turn, int):
        raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] has fields of the wrong type: {raw!r}")
    return ConversationMark(tenant=tenant, conversation_id=conversation_id, turn=turn)
