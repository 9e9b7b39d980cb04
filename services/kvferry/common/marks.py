"""The one typed definition of what kvferry adds to vLLM's ``kv_transfer_params``.

The router marks a decode request with the conversation it belongs to, under the single key
``"kvferry"``; the connector reads the mark when the request finishes and retains its blocks.
Requests without the key behave exactly as in plain vLLM.

Wire form (JSON, inside ``kv_transfer_params``)::

    "kvferry": {"tenant": "acme", "conversation_id": "c-42", "turn": 3}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MARK_KEY = "kvferry"


@dataclass(frozen=True)
class ConversationMark:
    tenant: str
    conversation_id: str
    turn: int

    def to_params(self) -> dict[str, Any]:
        return {MARK_KEY: {"tenant": self.tenant, "conversation_id": self.conversation_id, "turn": self.turn}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> ConversationMark | None:
        """The mark in ``params``, or None when absent. A malformed mark raises ValueError."""
        if not params or MARK_KEY not in params:
            return None
        raw = params[MARK_KEY]
        if not isinstance(raw, Mapping):
            raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] must be an object, got {type(raw).__name__}")
        try:
            tenant, conversation_id, turn = raw["tenant"], raw["conversation_id"], raw["turn"]
        except KeyError as missing:
            raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] lacks {missing}") from None
        if not isinstance(tenant, str) or not isinstance(conversation_id, str) or not isinstance(turn, int):
            raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] has fields of the wrong type: {raw!r}")
        return cls(tenant=tenant, conversation_id=conversation_id, turn=turn)
