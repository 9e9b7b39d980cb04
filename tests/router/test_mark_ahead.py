"""The turn's mark asked for before the body is read (``X-Conversation-Id``): the OpenAI HTTP API over the
runner, with the FAKE engines and registry of test_turns (the real registry and stand-ins: test_router_chat
and test_router_standin, whose turns name their conversation in the header too)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from kvferry.router.conversations import Conversations
from kvferry.router.http_api import HttpApi
from kvferry.router.limits import TenantLimits, TenantLimitSettings, TurnSlot
from kvferry.router.openai_responses import ResponseStore
from kvferry.router.tenants import ApiKeys

from tests.fixtures.polling import eventually
from tests.router.test_turns import PROMPT, TENANT, Cluster

pytestmark = pytest.mark.timeout(20)

KEY = "sk-acme"


def _client(cluster: Cluster) -> httpx.AsyncClient:
    app = HttpApi(
        runner=cluster.runner,
        keys=ApiKeys.from_pairs([(KEY, "acme")]),
        engines=cluster.runner._engines,
        conversations=Conversations(cluster.registry),  # type: ignore[arg-type]  # retention calls unused
        responses=ResponseStore(),
        registry_connected=lambda: True,
        max_body_bytes=1 << 20,
    ).app()
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")


def _headers(conversation: str | None = "c1") -> dict[str, str]:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    if conversation is not None:
        headers["x-conversation-id"] = conversation
    return headers


def _completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 3, **fields}).encode()


async def _after_the_mark(cluster: Cluster, body: bytes) -> AsyncIterator[bytes]:
    """The body's first half, then the rest only once the registry was asked for the turn's mark."""
    half = len(body) // 2
    yield body[:half]
    await eventually(lambda: cluster.registry.mark_calls, within=5, what="the turn's mark asked")
    yield body[half:]


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


async def test_the_mark_is_asked_while_the_body_is_still_coming(cluster: Cluster) -> None:
    async with _client(cluster) as client:
        answer = await client.post(
            "/v1/completions", content=_after_the_mark(cluster, _completion()), headers=_headers()
        )
        assert answer.status_code == 200, answer.text
        # The turn ran under the mark asked ahead (no second one), cleared at its end.
        begun = cluster.registry.mark_calls[0][1]
        assert cluster.registry.mark_calls == [("begin", begun), ("end", begun)]
        assert cluster.registry.marks == {}
        # The next turn pulls what this one retained, its mark asked ahead too.
        second = await client.post(
            "/v1/completions",
            content=_after_the_mark(cluster, _completion(prompt=[*PROMPT, 1, 2, 3, 4])),
            headers=_headers(),
        )
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["kvferry"]["reuse"] == "pull"


async def test_the_turn_line_counts_the_body_s_read_before_the_turn_s_clock(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """``request_read_ms``: from the handler's start to the turn's clock (the body's read and check), which
    the turn's own figures (``ttft_ms``, ``before_prefill_ms``) do not count."""
    body = _completion()

    async def slowly() -> AsyncIterator[bytes]:
        yield body[:10]
        await asyncio.sleep(0.2)
        yield body[10:]

    with caplog.at_level(logging.INFO, logger="kvferry.router.turns"):
        async with _client(cluster) as client:
            answer = await client.post("/v1/completions", content=slowly(), headers=_headers())
        assert answer.status_code == 200, answer.text
        _, direct = await cluster.turn(PROMPT, conversation="c2")
    over_http, over_runner = [vars(r) for r in caplog.records if r.getMessage() == "turn done"]
    assert over_http["request_read_ms"] >= 200, "the body's second half came 0.2 s after its first"
    assert over_runner["request_read_ms"] is None and direct.turn == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
async def test_a_body_refused_after_the_mark_was_asked_clears_it_before_the_answer(
    cluster: Cluster, path: str
) -> None:
    async with _client(cluster) as client:
        answer = await client.post(
            path, content=_after_the_mark(cluster, b'{"model": "m", "nonsense": 1}'), headers=_headers()
        )
    assert answer.status_code == 400, answer.text
    assert [call for call, _ in cluster.registry.mark_calls] == ["begin", "end"]
    assert cluster.registry.marks == {}


async def test_a_tenant_at_its_limit_asks_the_registry_nothing(cluster: Cluster) -> None:
    cluster.runner.tenant_limits = TenantLimits(TenantLimitSettings(max_concurrent_turns=1))
    held = cluster.runner.tenant_limits.admit(TENANT)
    try:
        async with _client(cluster) as client:
            answer = await client.post("/v1/completions", content=_completion(), headers=_headers())
    finally:
        held.release()
    assert answer.status_code == 429, answer.text
    assert cluster.registry.mark_calls == []


async def test_a_turn_refused_its_slot_after_the_mark_was_asked_clears_it(cluster: Cluster) -> None:
    # The tenant's last slot goes to another turn while this one's body is still coming.
    cluster.runner.tenant_limits = TenantLimits(TenantLimitSettings(max_concurrent_turns=1))
    slots: list[TurnSlot] = []

    async def body() -> AsyncIterator[bytes]:
        async for part in _after_the_mark(cluster, _completion()):
            yield part
            if not slots:  # the mark was asked before the body was read: another turn takes the slot now
                slots.append(cluster.runner.tenant_limits.admit(TENANT))

    async with _client(cluster) as client:
        answer = await client.post("/v1/completions", content=body(), headers=_headers())
    slots[0].release()
    assert answer.status_code == 429, answer.text
    assert [call for call, _ in cluster.registry.mark_calls] == ["begin", "end"]
    assert cluster.registry.marks == {}


async def test_a_mark_refused_ahead_is_the_turn_s_409(cluster: Cluster) -> None:
    cluster.registry.marks[("acme", "c1")] = "kvf-running"
    async with _client(cluster) as client:
        answer = await client.post("/v1/completions", content=_completion(), headers=_headers())
    assert answer.status_code == 409, answer.text
    assert "kvf-running" in answer.text
    assert cluster.registry.marks == {("acme", "c1"): "kvf-running"}, "the running turn's mark stays"


async def test_without_the_header_or_with_a_bad_one_nothing_is_asked_ahead(cluster: Cluster) -> None:
    async with _client(cluster) as client:
        bad = await client.post("/v1/completions", content=_completion(), headers=_headers("no spaces"))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-conversation-id"
        refused = await client.post(
            "/v1/completions", content=_completion(nonsense=1), headers=_headers(None)
        )
        assert refused.status_code == 400
    assert cluster.registry.mark_calls == []
