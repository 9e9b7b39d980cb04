"""A client that leaves before the first byte of a streamed turn: the turn's tenant slot and its
conversation's mark are given back at once, not at garbage collection nor when the mark's lease runs out.
Real registry (real etcd), the router's HTTP application driven as an ASGI 2.4 server drives it (a send to a
client that is gone raises OSError: Starlette gives up before the response's body starts), FAST STAND-IN
engines."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import MutableMapping
from typing import Any

import grpc
import pytest
from kvferry.v1 import registry_service_pb2 as registry_api
from starlette.requests import ClientDisconnect

from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.router import RouterFactory, StandInFactory, wait_for_engines

pytestmark = pytest.mark.timeout(60)


def _scope(path: str, body: bytes, key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8080),
    }


async def test_a_client_gone_before_the_first_byte_frees_its_slot_and_mark_at_once(
    router_factory: RouterFactory, standin_factory: StandInFactory, registry: RegistryHandle
) -> None:
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model)
    decode = await standin_factory("decode", model=model)
    router = await router_factory(max_turns_per_tenant=1)
    await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
    conversation = unique("conv")
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a story. " * 8}],
            "max_tokens": 8,
            "stream": True,
            "conversation_id": conversation,
        }
    ).encode()
    body_read = False
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}  # the client left while the turn started

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        raise OSError("the client closed the connection")

    with pytest.raises(ClientDisconnect):  # the server's to log
        await router.http_app(_scope("/v1/chat/completions", body, "key-acme"), receive, send)

    assert [message["type"] for message in sent] == ["http.response.start"], "no byte reached the client"
    # At once: nothing awaited since the response returned (no garbage collection, no lease).
    assert router.tenant_limits.in_flight("acme") == 0

    # The conversation's mark is ended, long before its lease (5 s) would have dropped it.
    stub = registry.stub()
    begin = registry_api.BeginTurnRequest(
        tenant="acme", conversation_id=conversation, request_id="kvf-next", holder="test", ttl_seconds=5
    )
    deadline = asyncio.get_running_loop().time() + 1.0
    while True:
        try:
            await stub.BeginTurn(begin, timeout=5)
            break
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.ABORTED, error
            assert asyncio.get_running_loop().time() < deadline, "the turn's mark is still held"
            await asyncio.sleep(0.02)
    await stub.EndTurn(
        registry_api.EndTurnRequest(tenant="acme", conversation_id=conversation, request_id="kvf-next"),
        timeout=5,
    )
