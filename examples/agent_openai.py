"""The agent loop of agent_sdk.py, with the official ``openai`` client against the router's HTTP API.

Existing agent frameworks work unchanged: the only kvferry-specific piece is the
``X-Conversation-Id`` header (``extra_headers``), which lets the router retain the conversation's KV
on the decode engine and pull it into the next turn's prefill. Per turn it prints the prompt length,
TTFT and pulled vs recomputed tokens from the router's ``usage`` (``stream_options.include_usage``).

The HTTP API has no renew call, so while the slow tool runs the retention would expire; when the
router's gRPC address is known (``--grpc-address`` / KVFERRY_ADDRESS) the loop keeps the conversation
alive with the SDK's ``keep_alive`` and closes it at the end. Run against ``kvferry up`` with the
environment file it writes (``KVFERRY_HTTP_URL`` is an OpenAI base URL, ``/v1`` included)::

    . ~/.local/state/kvferry/env && python examples/agent_openai.py
    # or: export KVFERRY_HTTP_URL=http://127.0.0.1:PORT/v1 KVFERRY_ADDRESS=127.0.0.1:PORT KVFERRY_API_KEY=KEY
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import openai
from kvferry.sdk import Client, KvferryError, NotFoundError

SYSTEM_PROMPT = (
    "You are a research agent. To look something up, answer exactly `CALL search(<query>)`; "
    "you will get the result as a tool message. Otherwise answer the user briefly."
)
TASKS = (
    "Which rivers cross Basel, and how wide is the widest one there?",
    "How long does a cargo barge take from Basel to Rotterdam?",
    "Summarise both answers in two sentences.",
)


async def search(query: str, seconds: float) -> str:
    """The simulated tool: slow (longer than the lease), then a canned answer."""
    await asyncio.sleep(seconds)
    return f"search results for {query!r}: [3 documents, {len(query) * 7} words]"


def print_usage(usage: Any) -> None:
    # The router adds its own fields to OpenAI's usage object; the openai client keeps them as extras.
    extra = usage.model_extra or {}
    details = extra.get("kvferry", {})
    print(
        f"  turn {details.get('turn', '?')}: prompt {usage.prompt_tokens} tokens, "
        f"TTFT {details.get('ttft_ms', 0):.0f} ms, pulled {extra.get('pulled_tokens', '?')} / "
        f"recomputed {extra.get('recomputed_tokens', '?')} ({details.get('reuse', '?')})"
    )


async def run_turn(
    llm: openai.AsyncOpenAI, model: str, conversation_id: str, messages: list[dict[str, str]], max_tokens: int
) -> str:
    """One turn, streamed; appends the assistant's reply to ``messages``."""
    stream = await llm.chat.completions.create(
        model=model,
        messages=messages,  # the whole history, as every OpenAI client sends it
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Conversation-Id": conversation_id},
    )
    parts: list[str] = []
    print("  assistant: ", end="", flush=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content.replace("\n", " "), end="", flush=True)
        if chunk.usage is not None:
            print()
            print_usage(chunk.usage)
    reply = "".join(parts)
    messages.append({"role": "assistant", "content": reply})
    return reply


@contextlib.asynccontextmanager
async def kept_alive(sdk: Client | None, conversation_id: str) -> AsyncIterator[None]:
    """Renews the conversation over gRPC while the block runs (nothing without a gRPC address)."""
    if sdk is None:
        yield
        return
    async with sdk.keep_alive(conversation_id) as keep_alive:
        yield
    status = f"lost: {keep_alive.error}" if keep_alive.error else "retention kept"
    print(f"  keep-alive: {keep_alive.renewals} renewals, {status}")


async def lease_seconds_left(sdk: Client | None, conversation_id: str) -> float:
    """How long the retention lives without renewal (10 s when unknown: no gRPC, nothing retained)."""
    if sdk is None:
        return 10.0
    try:
        info = await sdk.get_conversation(conversation_id)
    except NotFoundError:
        return 10.0
    return info.expire_time.timestamp() - time.time() if info.expire_time else 10.0


async def run_agent(args: argparse.Namespace) -> int:
    if not args.base_url:
        print(
            "error: pass --base-url or set KVFERRY_HTTP_URL (the router's OpenAI base URL)", file=sys.stderr
        )
        return 2
    llm = openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none", timeout=120.0)
    model = args.model or (await llm.models.list()).data[0].id
    sdk = await Client.connect(args.grpc_address, api_key=args.api_key) if args.grpc_address else None
    conversation_id = args.conversation_id or f"conv-{uuid.uuid4().hex}"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    print(f"conversation {conversation_id} on {args.base_url}, model {model}")
    if sdk is None:
        print("  (no gRPC address: the retention may expire while the tool runs)")
    try:
        for number, task in enumerate(TASKS, start=1):
            print(f"\ntask {number}: {task}")
            messages.append({"role": "user", "content": task})
            await run_turn(llm, model, conversation_id, messages, args.max_tokens)
            if number == len(TASKS):
                break
            seconds = args.tool_seconds
            if seconds is None:
                seconds = await lease_seconds_left(sdk, conversation_id) + 5.0
            print(f"  tool search({task[:40]!r}) for {seconds:.0f} s")
            async with kept_alive(sdk, conversation_id):
                result = await search(task, seconds)
            messages.append({"role": "tool", "content": result})
            await run_turn(llm, model, conversation_id, messages, args.max_tokens)
    finally:
        if sdk is not None:
            print(f"\nclosing {conversation_id}: its retained KV is released now")
            await sdk.close_conversation(conversation_id)
            await sdk.close()
        await llm.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--base-url",
        default=os.environ.get("KVFERRY_HTTP_URL"),
        help="router OpenAI base URL, e.g. http://127.0.0.1:8080/v1",
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
