"""Which retained prefix a prefill engine may pull from a decode engine, and until when it may start.

Both sides keep these rules: the router (and every other client) sends only block-aligned prefixes within
what is retained and hands out read deadlines inside the read window; the connector on P declines a pull
whose deadline is too near, and the connector on D keeps released blocks longer than any read window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.pd.kvferry_params import BlockGenerations
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks

# Recommended read window (seconds); must stay below the connector's release_grace_seconds (30).
DEFAULT_READ_WINDOW_SECONDS = 10.0


def read_deadline(
    lease_expire_time: float, now: float, window_seconds: float = DEFAULT_READ_WINDOW_SECONDS
) -> float:
    """The latest time a prefill may start reading a retention handed out at ``now`` (unix seconds): never
    after the lease ends, and within the read window."""
    return min(lease_expire_time, now + window_seconds)


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
    block_ids: tuple[int, ...]
    num_tokens: int
    nixl_host: str
    nixl_port: int
    block_size: int
    # When the retention's lease ends, unix seconds.
    lease_expire_time: float
    # One per block id, as the holder published them (empty: the holder does not fence pulls).
    block_generations: tuple[int, ...] = ()

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

    def prefix_generations(self, num_tokens: int) -> BlockGenerations | None:
        """The published generations of :meth:`prefix`'s blocks (None when the holder published none: the
        pull is then not checked)."""
        if not self.block_generations:
            return None
        return BlockGenerations(self.block_generations[: num_tokens // self.block_size])
