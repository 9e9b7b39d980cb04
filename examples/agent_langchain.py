"""A multi-turn tool-calling agent on LangChain's ``ChatOpenAI`` against kvferry's router.

Unchanged LangChain code plus two kvferry pieces: the ``X-Conversation-Id`` header on the model's
requests (``default_headers``), and the SDK's callback handler ``KvferryCallbackHandler``, which
renews the conversation while the (slow) tool runs and closes it at the end. Every model call after
the first reuses the retained history: the example prints the usage's ``cached_tokens`` and kvferry's
response headers for each call. Needs ``pip install langchain-openai 'kvferry-sdk[langchain]'``; run
against ``kvferry up`` with the environment file it writes::

    . ~/.local/state/kvferry/env && python examples/agent_langchain.py

The test model writes noise, so the first model call of each task forces the tool (``tool_choice``
names it); the call with the tool's result lets the model answer.
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
from kvferry.sdk import Client, KvferryError, NotFoundError
from kvferry.sdk.adapters.langchain import KvferryCallbackHandler
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

SYSTEM_PROMPT = (
    "You are a research agent. Look things up with the search tool, then answer the user briefly. "
    "Keep answers short and cite what the tool returned."
)
# The tool's one parameter is an enum: the demo model has dummy weights, and under guided decoding a free
# string would run on until max_tokens; an enum makes the model end the call's arguments.
SearchTopic = Literal["flights", "hotels", "weather"]
TASKS = (
    "Which rivers cross Basel, and how wide is the widest one there?",
    "How long does a cargo barge take from Basel to Rotterdam?",
    "Summarise both answers in two sentences.",
)
KVFERRY_HEADERS = ("x-kvferry-turn", "x-kvferry-reuse", "x-kvferry-pulled-tokens")


async def print_kvferry_headers(response: httpx.Response) -> None:
    """Prints kvferry's reuse headers of each model call (an httpx response hook)."""
    if response.request.url.path.endswith("/chat/completions"):
        shown = ", ".join(
            f"{name.removeprefix('x-kvferry-')} {response.headers.get(name, '?')}" for name in KVFERRY_HEADERS
        )
        print(f"  model call: {shown}")


def print_usage(message: AIMessage) -> None:
    usage: dict[str, Any] = message.response_metadata.get("token_usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    print(f"  usage: prompt {usage.get('prompt_tokens')} tokens, cached {cached}")


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
    sdk = await Client.connect(args.grpc_address, api_key=args.api_key)
    conversation_id = args.conversation_id or f"conv-{uuid.uuid4().hex}"
    http = httpx.AsyncClient(event_hooks={"response": [print_kvferry_headers]}, timeout=120.0)
    if not args.model:
        async with openai.AsyncOpenAI(base_url=args.base_url, api_key=args.api_key or "none") as listing:
            args.model = (await listing.models.list()).data[0].id

    @tool
    async def search(query: SearchTopic) -> str:
        """Searches the web for ``query``; slow (longer than the conversation's lease)."""
        seconds = args.tool_seconds
        if seconds is None:
            seconds = await lease_seconds_left(sdk, conversation_id) + 5.0
        print(f"  tool search({query[:40]!r}) for {seconds:.0f} s")
        await asyncio.sleep(seconds)
        return f"search results for {query!r}: [3 documents, {len(query) * 7} words]"

    llm = ChatOpenAI(
        model=args.model,
        base_url=args.base_url,
        api_key=args.api_key or "none",  # type: ignore[arg-type]
        max_completion_tokens=args.max_tokens,
        temperature=0.0,
        default_headers={"X-Conversation-Id": conversation_id},
        http_async_client=http,
    )
    forced = llm.bind_tools([search], tool_choice="search")
    answering = llm.bind_tools([search])
    handler = KvferryCallbackHandler(sdk, conversation_id, close_on_end=False)
    messages: list[BaseMessage] = [SystemMessage(SYSTEM_PROMPT)]
    print(f"conversation {conversation_id} on {args.base_url}, model {args.model}")
    try:
        for number, task in enumerate(TASKS, start=1):
            print(f"\ntask {number}: {task}")
            messages.append(HumanMessage(task))
            call = await forced.ainvoke(messages)
            assert isinstance(call, AIMessage)
            print_usage(call)
            messages.append(call)
            renewals = handler.renewals
            for tool_call in call.tool_calls:
                messages.append(await search.ainvoke(tool_call, config={"callbacks": [handler]}))
            status = f"lost: {handler.error}" if handler.error else "retention kept"
            print(f"  keep-alive: {handler.renewals - renewals} renewals during the tool, {status}")
            answer = await answering.ainvoke(messages)
            assert isinstance(answer, AIMessage)
            print_usage(answer)
            print(f"  answer: {str(answer.content)[:80]!r}")
            messages.append(answer)
    finally:
        print(f"\nclosing {conversation_id}: its retained KV is released now")
        await handler.aclose()
        await sdk.close()
        await http.aclose()
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
