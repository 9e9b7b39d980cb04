"""The router's HTTP server parses with httptools, a declared dependency: uvicorn takes it when importable and
otherwise parses in Python (h11), slower per request and per streamed chunk. The router names the protocol
uvicorn loaded in its ``router serving`` line (real registry and etcd)."""

from __future__ import annotations

import logging

import pytest
from kvferry.router.server import RouterConfig, start_router

from tests.fixtures.registry import RegistryHandle

pytestmark = pytest.mark.timeout(60)


async def test_the_router_serves_http_with_httptools(
    registry: RegistryHandle, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvferry")
    router = await start_router(
        RouterConfig(registry_address=registry.address, api_keys="sk-test=acme", startup_sync_seconds=0.5)
    )
    await router.stop(grace_seconds=0.5)
    [serving] = [record for record in caplog.records if record.getMessage() == "router serving"]
    assert serving.__dict__["http_protocol"] == "HttpToolsProtocol"
