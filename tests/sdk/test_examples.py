"""The examples run end to end against the real router (with the router tests' fast stand-in engines),
as their own processes, configured from the environment: agent_sdk.py and agent_openai.py, and the
framework agents (OpenAI Agents SDK, LangChain, LiteLLM) whose tool sleeps past the retention's TTL
while kvferry's adapter or keep-alive renews it, so every model call after the first still reuses."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.fixtures.router import ROUTER_API_KEYS, RouterFactory, StandInFactory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# The framework examples' engines retain for this long; their tool sleeps longer.
SHORT_TTL_SECONDS = 4
TOOL_SECONDS = SHORT_TTL_SECONDS + 2
# Three tasks, each a forced tool call and an answer (the Agents SDK example ends each run with the
# tool's result: its next model call is the next task's).
MODEL_CALLS = 6


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


async def _stack_env(
    router_factory: RouterFactory, standin_factory: StandInFactory, **engine_options: int
) -> dict[str, str]:
    model = f"example-model-{uuid.uuid4().hex[:8]}"
    await standin_factory("prefill", model=model, **engine_options)
    await standin_factory("decode", model=model, **engine_options)
    router = await router_factory()
    return {
        "KVFERRY_ADDRESS": router.grpc_address,
        "KVFERRY_HTTP_URL": f"{router.http_url}/v1",  # an OpenAI base URL, as `kvferry up` writes it
        "KVFERRY_API_KEY": next(iter(ROUTER_API_KEYS)),
        "KVFERRY_MODEL": model,
    }


@pytest.fixture
async def example_env(router_factory: RouterFactory, standin_factory: StandInFactory) -> dict[str, str]:
    return await _stack_env(router_factory, standin_factory)


@pytest.fixture
async def short_lease_env(router_factory: RouterFactory, standin_factory: StandInFactory) -> dict[str, str]:
    return await _stack_env(router_factory, standin_factory, retention_ttl_seconds=SHORT_TTL_SECONDS)


def _assert_tool_round_trips_reuse(output: str, model_calls: int = MODEL_CALLS) -> None:
    """Every model call after the first pulled the retained history (kvferry's headers and the usage's
    cached tokens), although each tool slept past the lease: the adapter renewed it meanwhile."""
    assert output.count("tool search(") == 3, output
    assert output.count("retention kept") == 3, output
    renewals = [
        int(line.split("keep-alive: ")[1].split()[0]) for line in output.splitlines() if "keep-alive:" in line
    ]
    assert len(renewals) == 3 and min(renewals) >= 2, output
    assert output.count("reuse none") == 1 and output.count("reuse pull") == model_calls - 1, output
    cached = [
        int(part.split("cached ")[1].split()[0].rstrip(","))
        for part in output.split("\n")
        if "cached " in part
    ]
    assert len(cached) == model_calls and cached[0] == 0 and min(cached[1:]) > 0, output
    assert "released now" in output


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


async def test_openai_agents_example(short_lease_env: dict[str, str]) -> None:
    output = await _run_example(
        "agent_openai_agents.py", short_lease_env, "--tool-seconds", str(TOOL_SECONDS)
    )
    _assert_tool_round_trips_reuse(output, model_calls=3)


async def test_langchain_example(short_lease_env: dict[str, str]) -> None:
    output = await _run_example("agent_langchain.py", short_lease_env, "--tool-seconds", str(TOOL_SECONDS))
    _assert_tool_round_trips_reuse(output)


async def test_litellm_example(short_lease_env: dict[str, str]) -> None:
    output = await _run_example("agent_litellm.py", short_lease_env, "--tool-seconds", str(TOOL_SECONDS))
    _assert_tool_round_trips_reuse(output)
