"""The blocking SyncClient over the STAND-IN RouterService (its private loop runs in a thread)."""

from __future__ import annotations

import asyncio
import time

import pytest
from kvferry.sdk import ChatMessage, NotFoundError, ReuseDecision, SyncClient

from tests.sdk.conftest import API_KEY
from tests.sdk.standin_router import StandInRouter


def test_sync_client_runs_a_conversation(standin_router: StandInRouter) -> None:
    standin_router.script.ttl_seconds = 1.0
    with SyncClient.connect(standin_router.address, api_key=API_KEY, environ={}) as client:
        with client.conversation() as conversation:
            stream = conversation.send(ChatMessage.user("hi"))
            assert [chunk.text for chunk in stream] == ["Hel", "lo", " there"]
            assert stream.summary.turn == 1
            with conversation.keep_alive() as keep_alive:
                time.sleep(1.5)  # a blocking tool call longer than the TTL
            assert keep_alive.renewals >= 3 and keep_alive.error is None
            reply = conversation.complete(ChatMessage.user("more"))
            assert reply.summary.reuse is ReuseDecision.PULL
            assert len(conversation.messages) == 4
        with pytest.raises(NotFoundError):
            client.get_conversation(conversation.id)


async def test_sync_client_refuses_to_block_an_event_loop() -> None:
    assert asyncio.get_running_loop()
    with pytest.raises(RuntimeError, match="async"):
        SyncClient.connect("127.0.0.1:1", environ={})
