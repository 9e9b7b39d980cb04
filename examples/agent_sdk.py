"""An agent loop on kvferry's SDK: per task a turn, a slow tool call, and a turn with the tool's result.

The tool runs longer than the conversation's base lease (TTL), which alone would drop the retained KV;
``conversation.keep_alive()`` renews it meanwhile, so the next turn still pulls the history from the
decode engine instead of recomputing it. Each turn prints the prompt length, TTFT and how many prompt
tokens were pulled vs recomputed.

Run against ``kvferry up``'s router with the environment file it writes (or export
``KVFERRY_ADDRESS=127.0.0.1:PORT KVFERRY_API_KEY=KEY`` yourself)::

    . ~/.local/state/kvferry/env
    python examples/agent_sdk.py                  # tool time: the lease's TTL + 5 s
    python examples/agent_sdk.py --no-keep-alive  # the same, to see the reuse lost

``kvferry up``'s test model (Qwen3's tokenizer, seeded random weights) writes noise, so it never asks
for a tool by itself: the agent calls the tool after each task unless the model's reply asks for one
as ``CALL search(query)``. Look at TTFT and the pulled tokens, not at the text.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from dataclasses import dataclass

from kvferry.sdk import ChatMessage, Client, Conversation, KvferryError, NotFoundError, TurnSummary

SYSTEM_PROMPT = (
    "You are a research agent. To look something up, answer exactly `CALL search(<query>)`; "
    "you will get the result as a tool message. Otherwise answer the user briefly."
)
TASKS = (
    "Which rivers cross Basel, and how wide is the widest one there?",
    "How long does a cargo barge take from Basel to Rotterdam?",
    "Summarise both answers in two sentences.",
)
_TOOL_CALL = re.compile(r"CALL\s+(\w+)\((.*?)\)")


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str


async def search(query: str, seconds: float) -> str:
    """The simulated tool: slow (longer than the lease), then a canned answer."""
    await asyncio.sleep(seconds)
    return f"search results for {query!r}: [3 documents, {len(query) * 7} words]"


def print_turn(label: str, summary: TurnSummary) -> None:
    print(
        f"  {label}: prompt {summary.prompt_tokens} tokens, TTFT {summary.ttft_ms:.0f} ms, "
        f"pulled {summary.pulled_tokens} / recomputed {summary.recomputed_tokens} "
        f"({summary.reuse.value}), P={summary.prefill_engine_id} D={summary.decode_engine_id}"
    )


async def run_turn(conversation: Conversation, message: ChatMessage, max_tokens: int) -> str:
    """One turn, streamed to stdout; the conversation appends the message and the reply to its history."""
    stream = conversation.send(message, max_tokens=max_tokens, temperature=0.0)
    print("  assistant: ", end="", flush=True)
    async for chunk in stream:
        print(chunk.text.replace("\n", " "), end="", flush=True)
    print()
    print_turn(f"turn {stream.summary.turn}", stream.summary)
    return stream.text


async def lease_seconds_left(conversation: Conversation) -> float | None:
    """How long the conversation's retention lives without renewal (None: nothing retained)."""
    try:
        info = await conversation.info()
    except NotFoundError:
        return None
    if info.expire_time is None:
        return None
    return info.expire_time.timestamp() - time.time()


async def run_agent(args: argparse.Namespace) -> int:
    async with await Client.connect(args.address, api_key=args.api_key) as client:
        history = [ChatMessage.system(SYSTEM_PROMPT)]
        conversation = client.conversation(args.conversation_id, history=history, model=args.model or "")
        async with conversation:
            print(f"conversation {conversation.id} on {client.config.address}")
            for number, task in enumerate(TASKS, start=1):
                print(f"\ntask {number}: {task}")
                reply = await run_turn(conversation, ChatMessage.user(task), args.max_tokens)
                asked = _TOOL_CALL.search(reply)
                if not asked and number == len(TASKS):
                    break  # the last task (a summary) needs no tool
                call = ToolCall(asked[1], asked[2]) if asked else ToolCall("search", task)
                left = await lease_seconds_left(conversation)
                seconds = args.tool_seconds if args.tool_seconds is not None else (left or 10.0) + 5.0
                ttl_note = f"lease has {left:.0f} s left" if left is not None else "nothing retained"
                print(f"  tool {call.name}({call.argument[:40]!r}) for {seconds:.0f} s ({ttl_note})")
                if args.keep_alive:
                    async with conversation.keep_alive() as keep_alive:
                        result = await search(call.argument, seconds)
                    status = f"lost: {keep_alive.error}" if keep_alive.error else "retention kept"
                    print(f"  keep-alive: {keep_alive.renewals} renewals, {status}")
                else:
                    result = await search(call.argument, seconds)
                await run_turn(conversation, ChatMessage.tool(result), args.max_tokens)
            print(f"\nclosing {conversation.id}: its retained KV is released now")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--address", default=os.environ.get("KVFERRY_ADDRESS"), help="router gRPC host:port")
    parser.add_argument("--api-key", default=os.environ.get("KVFERRY_API_KEY"), help="router API key")
    parser.add_argument("--model", default=os.environ.get("KVFERRY_MODEL"), help="default: the served model")
    parser.add_argument("--conversation-id", default=None, help="default: a fresh id")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--tool-seconds", type=float, default=None, help="tool duration; default: the lease's TTL + 5 s"
    )
    parser.add_argument("--no-keep-alive", dest="keep_alive", action="store_false")
    args = parser.parse_args()
    try:
        return asyncio.run(run_agent(args))
    except KvferryError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
