"""Which retained prefix a prefill engine may pull from a decode engine, and for how long it may start.

Both sides keep these rules: the router (and every other client) sends only block-aligned prefixes within
what is retained and hands out read windows safely under the holder's release grace; the connector on P
declines a pull whose window is too near its end, and the connector on D keeps released blocks a grace
longer than any read window.

**Read windows** are durations, never wall-clock instants: the clocks of the router, P and D disagree, and a
skewed clock must not widen a window. A window opens when the client looks the retention up (before it
tokenizes the prompt or plans the turn, so nothing after the lookup widens it); the prefill request carries
the time left (:meth:`ReadWindow.ms_left`); P's connector counts it from the request's arrival on its own
monotonic clock and checks it when it schedules the pull and again when it posts the READ.

**Safely under the grace** (:func:`max_read_window`): a window is at most half the holder's release grace.
The grace starts when the registry confirmed the end, which is no earlier than the lookup that opened the
window, so the window itself always fits; the other half covers what the window does not count: the
prefill request's way to P before P stamps its arrival, the READ's own duration after it is posted, and the
clocks' rate differences. Halving scales with the grace: a deployment that needs a long grace for a slow
network gets a proportionally longer margin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.pd.kvferry_params import DEVICE_TIER, HOST_TIER, BlockGenerations
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks

# Recommended read window (seconds): half the connector's default release_grace_seconds (30).
DEFAULT_READ_WINDOW_SECONDS = 10.0
# A read window is safely under a release grace when it is at most this share of it (module docs).
READ_WINDOW_SHARE_OF_GRACE = 0.5
# kvferry.v1.MEMORY_TIER_HOST: the holder's host pool (this floor does not import the API's types).
MEMORY_TIER_HOST = 2


def max_read_window(release_grace_seconds: float) -> float:
    """The longest read window safely under ``release_grace_seconds`` (module docs); 0 for a grace of 0."""
    return max(0.0, release_grace_seconds) * READ_WINDOW_SHARE_OF_GRACE


def read_window_fits(window_seconds: float, release_grace_seconds: float) -> bool:
    """Whether a read window of ``window_seconds`` is safely under ``release_grace_seconds`` (a grace of 0,
    or unknown, fits no window)."""
    return release_grace_seconds > 0 and window_seconds <= max_read_window(release_grace_seconds)


@dataclass(frozen=True)
class ReadWindow:
    """Until when a prefill may start reading a retention, on the monotonic clock of the client that looked
    it up (``time.monotonic()``; never compared with another machine's clock)."""

    closes_at: float

    @classmethod
    def opened(
        cls, looked_up_at: float, window_seconds: float, lease_seconds_left: float = math.inf
    ) -> ReadWindow:
        """The window of a retention looked up at ``looked_up_at`` (monotonic, taken *before* asking): the
        read window, or less when the holder's lease ends sooner (a holder that frees at its lease's end
        on its own; a registry-governed retention is freed only after the registry ended it, plus a grace
        longer than any read window, so its window needs no lease bound)."""
        return cls(looked_up_at + max(0.0, min(window_seconds, lease_seconds_left)))

    def seconds_left(self, now: float) -> float:
        """Seconds left at ``now`` (monotonic; negative once closed)."""
        return self.closes_at - now

    def ms_left(self, now: float) -> int:
        """Whole milliseconds left at ``now`` (monotonic), rounded down, never negative: what a prefill
        request carries (kvferry.pd.kvferry_params.READ_MS_KEY)."""
        return max(0, math.floor((self.closes_at - now) * 1000))


def max_reusable_tokens(prompt_len: int, matched_tokens: int, block_size: int) -> int:
    """The longest block-aligned prefix P may pull: within the verified match, and leaving at
    least one prompt token for P to compute (vLLM needs one to produce the first token)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    limit = min(matched_tokens, prompt_len - 1)
    return max(0, limit // block_size * block_size)


@dataclass(frozen=True)
class RetainedKv:
    """A retention on a decode engine that a prefill may pull its prompt prefix from.

    Built by the router from the registry's Retention and Engine records, or by a client from a decode
    engine's non-streaming answer (:meth:`from_decode_answer`).
    """

    engine_id: str
    engine_request_id: str
    block_ids: Sequence[int]
    num_tokens: int
    nixl_host: str
    nixl_port: int
    block_size: int
    # When the retention's lease ends, unix seconds (the holder's clock; an upper bound of the read window).
    lease_expire_time: float
    # One per block id, as the holder published them (empty: the holder does not fence pulls).
    block_generations: Sequence[int] = ()
    # Where the blocks live on the holder, a ``kvferry.v1.MemoryTier`` value: 0 not said (its KV cache), 1 its
    # KV cache, 2 its host pool. A pull names the blocks alike; a cost model may weigh the tier.
    tier: int = 0

    def __post_init__(self) -> None:
        if self.block_generations and len(self.block_generations) != len(self.block_ids):
            raise ValueError(
                f"{len(self.block_generations)} block generations for {len(self.block_ids)} block ids"
            )

    @classmethod
    def from_decode_answer(
        cls,
        handoff: KvHandoff | None,
        *,
        block_size: int,
        lease_expire_time: float,
        generations: BlockGenerations | None = None,
    ) -> RetainedKv | None:
        """What a decode engine's answer offers for the next turn (None when it names no blocks)."""
        blocks = handoff.blocks if handoff is not None else None
        if blocks is None or not blocks.num_tokens:
            return None
        return cls(
            engine_id=blocks.engine_id,
            engine_request_id=blocks.request_id,
            block_ids=blocks.block_ids[0],
            num_tokens=blocks.num_tokens,
            nixl_host=blocks.host,
            nixl_port=blocks.port,
            block_size=block_size,
            lease_expire_time=lease_expire_time,
            block_generations=generations.values if generations is not None else (),
        )

    def read_window(self, looked_up_at: float, window_seconds: float, now_wall: float) -> ReadWindow:
        """The read window of this retention for a client that learnt of it at ``looked_up_at`` (monotonic),
        with the wall clock at ``now_wall``: ``window_seconds``, or less when the lease ends sooner."""
        return ReadWindow.opened(looked_up_at, window_seconds, self.lease_expire_time - now_wall)

    def prefix(self, num_tokens: int) -> RemoteBlocks:
        """The first ``num_tokens`` (block-aligned, at most what is retained) as pull params.

        vLLM aligns the pulled blocks to the *end* of ``remote_block_ids``, so the list must
        hold exactly the blocks of the reused prefix.
        """
        if num_tokens <= 0 or num_tokens % self.block_size:
            raise ValueError(f"reuse of {num_tokens} tokens is not a positive multiple of {self.block_size}")
        if num_tokens > self.num_tokens:
            raise ValueError(f"reuse of {num_tokens} tokens exceeds the {self.num_tokens} retained")
        num_blocks = num_tokens // self.block_size
        if num_blocks > len(self.block_ids):
            raise ValueError(f"{num_blocks} blocks needed, retention lists {len(self.block_ids)}")
        return RemoteBlocks(
            engine_id=self.engine_id,
            request_id=self.engine_request_id,
            block_ids=(tuple(self.block_ids[:num_blocks]),),
            host=self.nixl_host,
            port=self.nixl_port,
            num_tokens=num_tokens,
        )

    @property
    def pull_tier(self) -> str:
        """Which of the holder's tiers a pull of these blocks reads (kvferry.pd.kvferry_params.PULL_TIERS)."""
        return HOST_TIER if self.tier == MEMORY_TIER_HOST else DEVICE_TIER

    def prefix_generations(self, num_tokens: int) -> BlockGenerations | None:
        """The published generations of :meth:`prefix`'s blocks (None when the holder published none: the
        pull is then not checked)."""
        if not self.block_generations:
            return None
        return BlockGenerations(tuple(self.block_generations[: num_tokens // self.block_size]))
