"""A multi-turn agent on the OpenAI Agents SDK (Responses API, a function tool) against kvferry's router.

Unchanged Agents SDK code plus two kvferry pieces: the ``X-Conversation-Id`` header on the model's
requests (``ModelSettings.extra_headers``), and the SDK's run hook ``KvferryRunHooks``, which renews the
conversation while the (slow) tool runs and closes it at the end. Every model call after the first
reuses the retained history: the example prints the Responses usage's ``cached_tokens`` and kvferry's
response headers for each call. Needs ``pip install 'kvferry-sdk[openai-agents]'``; run against
``kvferry up`` with the environment file it writes::

    . ~/.local/state/kvferry/env && python examples/agent_openai_agents.py

The test model writes noise, so each task's model call is made to call the tool (``tool_choice`` names
it) and the run ends with the tool's result (``tool_use_behavior="stop_on_first_tool"``): a noise
answer would run to ``max_tokens``, which the Agents SDK raises as an error (a Responses status of
"incomplete"). The next task's model call carries the tool's result and reuses it with the rest.
With a real model, drop both settings and let the agent answer. Tracing to OpenAI's servers is off:
nothing leaves the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import Any, Literal

import httpx
import openai
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    TResponseInputItem,
    function_tool,
    set_tracing_disabled,
)
from kvferry.sdk import Client, KvferryError, NotFoundError
from kvferry.sdk.adapters.openai_agents import KvferryRunHooks

# The tool's one parameter is an enum: the demo model has dummy weights, and under guided decoding a free
# string would run on until max_tokens; an enum makes the model end the call's arguments.
SearchTopic = Literal["flights", "hotels", "weather"]
INSTRUCTIONS = (
    "You are a research agent. Look things up with the search tool, then answer the user briefly. "
    "Keep answers short and cite what the tool returned."
)
TASKS = (
    "Which rivers cross Basel, and how wide is the widest one there?",
    "How long does a cargo barge take from Basel to Rotterdam?",
    "Summarise both answers in two sentences.",
)
KVFERRY_HEADERS = ("x-kvferry-turn", "x-kvferry-reuse", "x-kvferry-pulled-tokens")


def print_kvferry_headers(response: httpx.Response) -> None:
    """Prints kvferry's reuse headers of each model call (an httpx response hook)."""
    if response.request.url.path.endswith("/responses"):
        shown = ", ".join(
            f"{name.removeprefix('x-kvferry-')} {response.headers.get(name, '?')}" for name in KVFERRY_HEADERS
        )
        print(f"  model call: {shown}")


async def on_response(response: httpx.Response) -> None:
    print_kvferry_headers(response)


async def lease_seconds_left(sdk: Client, conversation_id: str) -> float:
    """How long the retention lives without renewal (10 s when unknown)."""
    try:
        info = await sdk.get_conversation(conversation_id)
    except NotFoundError:
        return 10.0
    return info.expire_time.timestamp() - time.time() if info.expire_time else 10.0


async def run_agent(args: argparse.Namespace) -> int:
    if not args.base_url or not args.grpc_address:
        print(
            "error: set KVFERRY_HTTP_URL and KVFERRY_ADDRESS (or pass --base-url, --grpc-address)",
            file=sys.stderr,
        )
        return 2
    set_tracing_disabled(True)
    http = httpx.AsyncClient(event_hooks={"response": [on_response]}, timeout=120.0)
    llm = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", http_client=http)
    model_name = args.model or (await llm.models.list()).data[0].id
    sdk = await Client.connect(args.grpc_address, api_key=args.api_key)
    conversation_id = args.conversation_id or f"conv-{uuid.uuid4().hex}"
    tool_seconds: list[float] = []

    @function_tool
    async def search(query: SearchTopic) -> str:
        """Searches the web for ``query``; slow (longer than the conversation's lease)."""
        seconds = args.tool_seconds
        if seconds is None:
            seconds = await lease_seconds_left(sdk, conversation_id) + 5.0
        print(f"  tool search({query[:40]!r}) for {seconds:.0f} s")
        tool_seconds.append(seconds)
        await asyncio.sleep(seconds)
        return f"search results for {query!r}: [3 documents, {len(query) * 7} words]"

    agent = Agent(
        name="researcher",
        instructions=INSTRUCTIONS,
        tools=[search],
        tool_use_behavior="stop_on_first_tool",
        model=OpenAIResponsesModel(model=model_name, openai_client=llm),
        model_settings=ModelSettings(
            tool_choice="search",
            max_tokens=args.max_tokens,
            temperature=0.0,
            extra_headers={"X-Conversation-Id": conversation_id},
        ),
    )
    hooks = KvferryRunHooks(sdk, conversation_id, close_on_end=False)
    history: list[TResponseInputItem] = []
    print(f"conversation {conversation_id} on {args.base_url}, model {model_name}")
    try:
        for number, task in enumerate(TASKS, start=1):
            print(f"\ntask {number}: {task}")
            renewals = hooks.renewals
            result = await Runner.run(agent, [*history, {"role": "user", "content": task}], hooks=hooks)
            for call, response in enumerate(result.raw_responses, start=1):
                usage: Any = response.usage
                print(
                    f"  usage of call {call}: input {usage.input_tokens} tokens, "
                    f"cached {usage.input_tokens_details.cached_tokens}"
                )
            status = f"lost: {hooks.error}" if hooks.error else "retention kept"
            print(f"  keep-alive: {hooks.renewals - renewals} renewals during the tool, {status}")
            print(f"  answer: {str(result.final_output)[:80]!r}")
            history = result.to_input_list()
    finally:
        print(f"\nclosing {conversation_id}: its retained KV is released now")
        await hooks.aclose()
        await sdk.close()
        await llm.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--base-url", default=os.environ.get("KVFERRY_HTTP_URL"), help="router OpenAI base URL"
    )
    parser.add_argument(
        "--grpc-address", default=os.environ.get("KVFERRY_ADDRESS"), help="router gRPC host:port (keep-alive)"
    )
    parser.add_argument("--api-key", default=os.environ.get("KVFERRY_API_KEY"), help="router API key")
    parser.add_argument("--model", default=os.environ.get("KVFERRY_MODEL"), help="default: the served model")
    parser.add_argument("--conversation-id", default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--tool-seconds", type=float, default=None, help="default: the lease's TTL + 5 s")
    args = parser.parse_args()
    try:
        return asyncio.run(run_agent(args))
    except (KvferryError, openai.APIError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
