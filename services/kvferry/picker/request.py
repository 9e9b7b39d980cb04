"""What the picker reads from a request: the conversation, the model and the API key, the way the router's
HTTP API reads them (``X-Conversation-Id`` or the body's ``conversation_id``, a mismatch refused; else
``prompt_cache_key``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from kvferry.router import validation
from kvferry.router.http_api import CONVERSATION_HEADER, conversation_of
from kvferry.runtime.errors import InvalidArgument


@dataclass(frozen=True)
class RequestIdentity:
    conversation_id: str | None
    # The body's ``model`` ("" when the request names none, or has no JSON body).
    model: str
    authorization: str | None


def request_identity(headers: Mapping[str, str], body: bytes) -> RequestIdentity:
    """Reads a request's identity from its (lower-cased) headers and whole body; ``InvalidArgument`` when
    the body is not a JSON object or disagrees with the header."""
    fields: dict[str, object] = {}
    if body.strip():
        try:
            parsed = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InvalidArgument(f"the request body is not JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise InvalidArgument(f"the request body must be a JSON object, not {type(parsed).__name__}")
        fields = parsed
    conversation = conversation_of(
        headers.get(CONVERSATION_HEADER),
        _string_field(fields, "conversation_id"),
        _string_field(fields, "prompt_cache_key"),
    )
    model = validation.model_name(_string_field(fields, "model") or "")
    return RequestIdentity(conversation, model, headers.get("authorization"))


def _string_field(fields: Mapping[str, object], name: str) -> str | None:
    value = fields.get(name)
    if value is None or isinstance(value, str):
        return value
    raise InvalidArgument(f"{name} must be a string", param=name)
