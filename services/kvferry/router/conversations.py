"""Keeping a conversation alive, closing it and describing it: the calls an agent makes between turns.

One implementation behind both front doors: gRPC ``RenewConversation`` / ``CloseConversation`` /
``GetConversation`` and HTTP ``POST /v1/kvferry/conversations/{id}/renew``, ``DELETE`` and ``GET
/v1/kvferry/conversations/{id}``. Every call is scoped to the caller's tenant (rule 5 of the design).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from kvferry.router.registry_client import RegistryApi, RegistryUnavailable, RetentionRecord
from kvferry.router.validation import conversation_id
from kvferry.runtime.errors import NotFound, Unavailable

_T = TypeVar("_T")


class Conversations:
    def __init__(self, registry: RegistryApi) -> None:
        self._registry = registry

    async def renew(self, tenant: str, raw_conversation_id: str) -> float:
        """Extends the retention's lease; the new lease end (Unix seconds)."""
        conv = conversation_id(raw_conversation_id)
        expire = await _registry_call(self._registry.renew_retention(tenant, conv))
        if expire is None:
            raise _nothing_retained(conv)
        return expire

    async def close(self, tenant: str, raw_conversation_id: str) -> None:
        """Releases the retained KV at once; idempotent (closing what is already gone succeeds)."""
        conv = conversation_id(raw_conversation_id)
        await _registry_call(self._registry.release_retention(tenant, conv))

    async def describe(self, tenant: str, raw_conversation_id: str) -> RetentionRecord:
        conv = conversation_id(raw_conversation_id)
        record = await _registry_call(self._registry.get_retention(tenant, conv))
        if record is None:
            raise _nothing_retained(conv)
        return record


async def _registry_call(call: Awaitable[_T]) -> _T:
    try:
        return await call
    except RegistryUnavailable as error:
        raise Unavailable(f"the registry is unavailable, retry shortly ({error})") from None


def _nothing_retained(conv: str) -> NotFound:
    return NotFound(
        f"conversation {conv!r} has nothing retained (it expired, was closed, or has not finished a turn); "
        "its next turn recomputes the prompt",
    )
