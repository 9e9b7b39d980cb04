"""A multi-turn tool-calling agent on LiteLLM against kvferry's router (an OpenAI-compatible server).

Unchanged LiteLLM code plus the ``X-Conversation-Id`` header (``extra_headers``); while the (slow) tool
runs the SDK's ``keep_alive`` renews the conversation, and the agent closes it at the end. Every model
call after the first reuses the retained history: the example prints the usage's ``cached_tokens``
and kvferry's response headers for each call. Needs ``pip install litellm kvferry-sdk``; run against
``kvferry up`` with the environment file it writes::

    . ~/.local/state/kvferry/env && LITELLM_LOCAL_MODEL_COST_MAP=True python examples/agent_litellm.py

LITELLM_LOCAL_MODEL_COST_MAP keeps LiteLLM from fetching its model price list from the internet at
import (this example sets it when unset). The test model writes noise, so the first model call of
each task forces the tool (``tool_choice`` names it); the call with the tool's result lets it answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import openai
from kvferry.sdk import Client, KvferryError, NotFoundError

SYSTEM_PROMPT = (
    "You are a research agent. Look things up with the search tool, then answer the user briefly. "
    "Keep answers short and cite what the tool returned."
)
TASKS = (
    "Which rivers cross Basel, and how wide is the widest one there?",
    "How long does a cargo barge take from Basel to Rotterdam?",
    "Summarise both answers in two sentences.",
)
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web; slow (longer than the conversation's lease).",
        # An enum: the demo model has dummy weights, and under guided decoding a free string would run on
        # until max_tokens; an enum makes the model end the call's arguments.
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "enum": ["flights", "hotels", "weather"]}},
            "required": ["query"],
        },
    },
}
KVFERRY_HEADERS = ("x-kvferry-turn", "x-kvferry-reuse", "x-kvferry-pulled-tokens")


def print_call(response: Any) -> None:
    """Prints kvferry's reuse headers (LiteLLM keeps the server's headers prefixed ``llm_provider-``)
    and the usage's cached tokens."""
    headers = response._hidden_params.get("additional_headers") or {}
    shown = ", ".join(
        f"{name.removeprefix('x-kvferry-')} {headers.get('llm_provider-' + name, '?')}"
        for name in KVFERRY_HEADERS
    )
    details = response.usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None else None
    print(f"  model call: {shown}; usage: prompt {response.usage.prompt_tokens} tokens, cached {cached}")


async def search(query: str, seconds: float) -> str:
    """The simulated tool: slow (longer than the lease), then a canned answer."""
    await asyncio.sleep(seconds)
    return f"search results for {query!r}: [3 documents, {len(query) * 7} words]"


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
    if not args.model:
        async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none") as listing:
            args.model = (await listing.models.list()).data[0].id
    sdk = await Client.connect(args.grpc_address, api_key=args.api_key)
    conversation_id = args.conversation_id or f"conv-{uuid.uuid4().hex}"
    common: dict[str, Any] = {
        "model": f"openai/{args.model}",  # LiteLLM's prefix for any OpenAI-compatible server
        "api_base": args.base_url,
        "api_key": args.api_key or "none",
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "tools": [SEARCH_TOOL],
        "extra_headers": {"X-Conversation-Id": conversation_id},
    }
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    print(f"conversation {conversation_id} on {args.base_url}, model {args.model}")
    try:
        for number, task in enumerate(TASKS, start=1):
            print(f"\ntask {number}: {task}")
            messages.append({"role": "user", "content": task})
            forced = {"type": "function", "function": {"name": "search"}}
            call = await litellm.acompletion(messages=messages, tool_choice=forced, **common)
            print_call(call)
            message = call.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for tool_call in message.tool_calls or []:
                query = str(json.loads(tool_call.function.arguments or "{}").get("query", task))
                seconds = args.tool_seconds
                if seconds is None:
                    seconds = await lease_seconds_left(sdk, conversation_id) + 5.0
                print(f"  tool search({query[:40]!r}) for {seconds:.0f} s")
                async with sdk.keep_alive(conversation_id) as keep_alive:
                    result = await search(query, seconds)
                status = f"lost: {keep_alive.error}" if keep_alive.error else "retention kept"
                print(f"  keep-alive: {keep_alive.renewals} renewals during the tool, {status}")
                messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result})
            answer = await litellm.acompletion(messages=messages, **common)
            print_call(answer)
            reply = answer.choices[0].message
            print(f"  answer: {str(reply.content)[:80]!r}")
            messages.append(reply.model_dump(exclude_none=True))
    finally:
        print(f"\nclosing {conversation_id}: its retained KV is released now")
        try:
            await sdk.close_conversation(conversation_id)
        except NotFoundError:
            pass
        await sdk.close()
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
    except (KvferryError, openai.APIError, litellm.exceptions.APIError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
