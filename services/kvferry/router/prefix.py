"""Which leading part of a new prompt a conversation's retained KV covers (rule 2 of docs/design.md).

Reuse is block-aligned and proven by the digest chain: block ``i`` is reusable only if the prompt's
digest ``i`` equals the retained digest ``i``, which holds only if every token before it matches.
An edited history therefore keeps only the blocks before the first edited one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.pd.digest import block_digests, matching_blocks


@dataclass(frozen=True)
class PrefixMatch:
    # Leading blocks of the prompt whose KV the retention holds.
    blocks: int
    # The same, in tokens (``blocks * block_size``).
    tokens: int


NO_MATCH = PrefixMatch(blocks=0, tokens=0)


@dataclass(frozen=True)
class PromptDigests:
    """The digests of a prompt's leading blocks under one salt and block size, hashed ahead (while the
    turn's mark is in flight) for the prefix check; good for any retention whose holder has that salt and
    block size, as far as they reach."""

    salt: str
    block_size: int
    digests: Sequence[bytes]


def comparable_blocks(
    prompt_len: int,
    *,
    retained_digests: Sequence[bytes],
    retained_num_tokens: int,
    retained_num_blocks: int,
    block_size: int,
) -> int:
    """How many leading blocks of a prompt of ``prompt_len`` tokens the retention could hold: at least one
    prompt token is always left to compute (the engine needs it to produce the first output token), so a
    prompt that is all retained gives up its last block."""
    if block_size <= 0 or not retained_digests:
        return 0
    return max(
        0,
        min(
            len(retained_digests),
            retained_num_blocks,
            retained_num_tokens // block_size,
            (prompt_len - 1) // block_size,
        ),
    )


def match_retained_prefix(
    prompt_token_ids: Sequence[int],
    *,
    retained_digests: Sequence[bytes],
    retained_num_tokens: int,
    retained_num_blocks: int,
    block_size: int,
    salt: str,
    hashed: PromptDigests | None = None,
) -> PrefixMatch:
    """The longest block-aligned prefix of the prompt that the retention holds (``comparable_blocks`` at
    most). ``hashed``: the prompt's digests if already hashed (used when their salt, block size and reach
    fit)."""
    limit = comparable_blocks(
        len(prompt_token_ids),
        retained_digests=retained_digests,
        retained_num_tokens=retained_num_tokens,
        retained_num_blocks=retained_num_blocks,
        block_size=block_size,
    )
    if limit <= 0:
        return NO_MATCH
    if (
        hashed is not None
        and (hashed.salt, hashed.block_size) == (salt, block_size)
        and len(hashed.digests) >= limit
    ):
        prompt_digests = hashed.digests[:limit]
    else:
        # Hash only as much of the prompt as could match.
        prompt_digests = block_digests(prompt_token_ids[: limit * block_size], block_size, salt=salt)
    blocks = matching_blocks(retained_digests[:limit], prompt_digests)
    return PrefixMatch(blocks=blocks, tokens=blocks * block_size)
