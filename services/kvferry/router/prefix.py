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


def match_retained_prefix(
    prompt_token_ids: Sequence[int],
    *,
    retained_digests: Sequence[bytes],
    retained_num_tokens: int,
    retained_num_blocks: int,
    block_size: int,
    salt: str,
) -> PrefixMatch:
    """The longest block-aligned prefix of the prompt that the retention holds.

    At least one prompt token is always left to compute: the engine needs it to produce the
    first output token, so a prompt that is all retained gives up its last block.
    """
    if block_size <= 0 or not retained_digests:
        return NO_MATCH
    limit = min(
        len(retained_digests),
        retained_num_blocks,
        retained_num_tokens // block_size,
        (len(prompt_token_ids) - 1) // block_size,
    )
    if limit <= 0:
        return NO_MATCH
    # Hash only as much of the prompt as could match.
    prompt_digests = block_digests(prompt_token_ids[: limit * block_size], block_size, salt=salt)
    blocks = matching_blocks(retained_digests[:limit], prompt_digests)
    return PrefixMatch(blocks=blocks, tokens=blocks * block_size)
