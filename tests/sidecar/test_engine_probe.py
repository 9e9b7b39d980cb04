"""The sidecar's HTTP probe of its engine, against a loopback server that answers as vLLM does (the same probe
runs beside real engines in tests/sidecar/test_sidecar_engines.py)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from kvferry.sidecar.engine import EngineFacts, EngineProbeError, HttpEngineProbe, ProbeResult

from tests.fixtures.http_answers import answering

METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0
"""


@asynccontextmanager
async def probing(url: str) -> AsyncIterator[HttpEngineProbe]:
    probe = HttpEngineProbe(url, timeout_seconds=2)
    try:
        yield probe
    finally:
        await probe.close()


async def test_a_healthy_engine_is_ok_and_says_its_model_and_cache() -> None:
    async def engine(request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response()
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "qwen", "max_model_len": 8192}]})
        return web.Response(text=METRICS)

    async with answering(engine) as url, probing(url) as probe:
        assert await probe.check_health() is ProbeResult.OK
        assert await probe.read_facts() == EngineFacts("qwen", 8192, 16, 4096)


async def test_an_engine_that_errs_is_failing_and_one_without_a_model_is_refused() -> None:
    async def sick(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"data": []})
        return web.Response(status=503)

    async with answering(sick) as url, probing(url) as probe:
        assert await probe.check_health() is ProbeResult.FAILING
        with pytest.raises(EngineProbeError, match="no model"):
            await probe.read_facts()


async def test_metrics_that_cannot_be_read_leave_the_cache_facts_unknown() -> None:
    async def no_metrics(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": "qwen"}]})
        return web.Response(status=404)

    async with answering(no_metrics) as url, probing(url) as probe:
        assert await probe.read_facts() == EngineFacts("qwen", None, None, None)


async def test_nothing_listening_is_unreachable() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    async with probing(f"http://127.0.0.1:{port}") as probe:
        assert await probe.check_health() is ProbeResult.UNREACHABLE
        with pytest.raises(EngineProbeError, match="v1/models"):
            await probe.read_facts()
