"""The demo ``kvferry up`` runs: one multi-turn agent conversation through the SDK, printing per turn
the prompt length, TTFT and how many prompt tokens were pulled from the decode engine vs recomputed."""

from __future__ import annotations

import asyncio

from kvferry.sdk import ChatMessage, Client

SYSTEM_PROMPT = (
    "You are a coding agent. You read files, run tools and report what you found. "
    "Answer briefly and cite the tool output you used."
)
# What the demo says of the model it runs on (kvferry up's default: kvferry.stack.tiny_model).
TEST_MODEL = (
    "The model is the repo's test model (.models/tiny-qwen3): a small Qwen3 with Qwen3's tokenizer and\n"
    "seeded random weights, so its text is noise (the examples print it)."
)
GPU_MODEL = (
    "The model has Qwen3-8B's shape and vLLM's dummy weights, so its text is noise (the examples print it)."
)
TOOL_OUTPUT_LINE = (
    "src/kvferry/module_{i}.py:{j}: def handler_{i}_{j}(request, context): return process(request)"
)


def tool_output(turn: int, lines: int) -> str:
    """A synthetic tool result (a grep over a code base), so the conversation grows every turn."""
    return "\n".join(TOOL_OUTPUT_LINE.format(i=turn, j=j) for j in range(lines))


async def run_demo(
    address: str, api_key: str, turns: int = 6, tool_lines: int = 12, model: str = TEST_MODEL
) -> None:
    async with await Client.connect(address, api_key=api_key) as client:
        async with client.conversation() as conversation:
            print(
                f"demo conversation {conversation.id}: {turns} turns.\n"
                f"{model}\n"
                "Look at the numbers: TTFT, and how many prompt tokens the prefill engine pulled from the\n"
                "decode engine's retained KV vs recomputed. From turn 2 it pulls the history and computes\n"
                "only the new tokens, so TTFT stays flat as the prompt grows (reuse says `recompute` where\n"
                "the router found recomputing the history cheaper than pulling it)."
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


def main(address: str, api_key: str, turns: int, model: str = TEST_MODEL) -> None:
    asyncio.run(run_demo(address, api_key, turns, model=model))
