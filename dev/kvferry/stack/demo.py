"""The demo ``kvferry up`` runs: one multi-turn agent conversation through the SDK, printing per turn
the prompt length, TTFT and how many prompt tokens were pulled from the decode engine vs recomputed."""

from __future__ import annotations

import asyncio

from kvferry.sdk import ChatMessage, Client

SYSTEM_PROMPT = (
    "You are a coding agent. You read files, run tools and report what you found. "
    "Answer briefly and cite the tool output you used."
)
TOOL_OUTPUT_LINE = (
    "src/kvferry/module_{i}.py:{j}: def handler_{i}_{j}(request, context): return process(request)"
)


def tool_output(turn: int, lines: int) -> str:
    """A synthetic tool result (a grep over a code base), so the conversation grows every turn."""
    return "\n".join(TOOL_OUTPUT_LINE.format(i=turn, j=j) for j in range(lines))


async def run_demo(address: str, api_key: str, turns: int = 6, tool_lines: int = 12) -> None:
    async with await Client.connect(address, api_key=api_key) as client:
        async with client.conversation() as conversation:
            print(
                f"demo conversation {conversation.id}: {turns} turns.\n"
                "The demo model has dummy weights (seeded noise), so its replies are gibberish: look at the\n"
                "numbers. From turn 2 the prefill engine pulls the history's KV from the decode engine\n"
                "(pulled) and computes only the new tokens (recomputed), which keeps TTFT flat as the\n"
                "prompt grows."
            )
            print(f"{'turn':>4} {'prompt':>7} {'TTFT ms':>8} {'pulled':>7} {'recomputed':>10}  reuse")
            for turn in range(1, turns + 1):
                # The conversation keeps the history: each turn sends only its new messages.
                new = [ChatMessage.system(SYSTEM_PROMPT)] if turn == 1 else []
                new.append(
                    ChatMessage.user(
                        f"Turn {turn}: here is what the tool returned.\n" + tool_output(turn, tool_lines)
                    )
                )
                reply = await conversation.complete(new, max_tokens=24, temperature=0.0)
                summary = reply.summary
                print(
                    f"{turn:>4} {summary.prompt_tokens:>7} {summary.ttft_ms:>8.0f} "
                    f"{summary.pulled_tokens:>7} {summary.recomputed_tokens:>10}  {summary.reuse.value}"
                )
            print("closing the conversation releases its retained KV on the decode engine")


def main(address: str, api_key: str, turns: int) -> None:
    asyncio.run(run_demo(address, api_key, turns))
