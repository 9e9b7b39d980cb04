"""examples/agent_sdk.py and examples/agent_openai.py run end to end against the real router (with
the router tests' fast stand-in engines), as their own processes, configured from the environment."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.fixtures.router import ROUTER_API_KEYS, RouterFactory, StandInFactory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


async def _run_example(name: str, env: dict[str, str], *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLES / name),
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    text = output.decode()
    assert process.returncode == 0, text
    return text


@pytest.fixture
async def example_env(router_factory: RouterFactory, standin_factory: StandInFactory) -> dict[str, str]:
    model = f"example-model-{uuid.uuid4().hex[:8]}"
    await standin_factory("prefill", model=model)
    await standin_factory("decode", model=model)
    router = await router_factory()
    return {
        "KVFERRY_ADDRESS": router.grpc_address,
        "KVFERRY_HTTP_URL": f"{router.http_url}/v1",  # an OpenAI base URL, as `kvferry up` writes it
        "KVFERRY_API_KEY": next(iter(ROUTER_API_KEYS)),
        "KVFERRY_MODEL": model,
    }


async def test_agent_sdk_example(example_env: dict[str, str]) -> None:
    output = await _run_example("agent_sdk.py", example_env, "--tool-seconds", "1")
    assert output.count("keep-alive:") == 2 and "retention kept" in output
    assert output.count("(pull)") >= 3
    assert "released now" in output


async def test_agent_openai_example(example_env: dict[str, str]) -> None:
    output = await _run_example("agent_openai.py", example_env, "--tool-seconds", "1")
    assert output.count("keep-alive:") == 2 and "retention kept" in output
    assert output.count("(pull)") >= 3
    assert "released now" in output
