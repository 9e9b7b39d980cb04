"""Which leading part of a new prompt a conversation's retained KV covers (rule 2 of docs/design.md).

Reuse is block-aligned and proven by the digest chain: block ``i`` is reusable only if the prompt's
digest ``i`` equals the retained digest ``i``, which holds only if every token before it matches.
An edited history therefore keeps only the blocks before the first edited one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.pd.digest import (
    DIGEST_BYTES,
    PackedDigests,
    block_digests,
    chain_digests,
    chain_start,
    matching_blocks,
    pack_token_ids,
)


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


@dataclass(frozen=True)
class _Hashed:
    salt: str
    block_size: int
    # SHA-256 of the packed token ids the digests cover.
    tokens_sha256: bytes
    digests: PackedDigests


# What an entry costs besides its digests (the key's strings, the entry, the dictionary's slot).
_ENTRY_OVERHEAD_BYTES = 400


class PromptDigestCache:
    """The digests of each conversation's last hashed prompt, with one SHA-256 of the tokens they cover.

    An agent resends its whole conversation every turn, so a turn's prompt mostly begins with the previous
    turn's: when one hash of those tokens (one C call: ~0.1 ms for 25,000 tokens) shows it does, their
    digests are taken as they are and only the new blocks are chained on, instead of hashing every block
    again (~1.3 us each in Python: ~2 ms at 25,000 tokens). What a turn reuses is still proven by the chain
    (rule 2): the cached digests are the chain of exactly those tokens. Least recently used entries go once
    the cache holds more than ``max_bytes``.
    """

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[tuple[str, str], _Hashed] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def digests(
        self, conversation: tuple[str, str], token_ids: Sequence[int], *, block_size: int, salt: str
    ) -> Sequence[bytes]:
        """:func:`~kvferry.pd.digest.block_digests` of ``token_ids``, reusing what this conversation's last
        prompt hashed (``conversation``: tenant, conversation id)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        packed = memoryview(pack_token_ids(token_ids[: len(token_ids) // block_size * block_size]))
        tokens_sha256 = hashlib.sha256()
        known: PackedDigests | None = None
        last = self._entries.pop(conversation, None)
        if last is not None:
            self._bytes -= _entry_bytes(last)
            covered = len(last.digests) * block_size * 8
            if (last.salt, last.block_size) == (salt, block_size) and covered <= len(packed):
                tokens_sha256.update(packed[:covered])
                if tokens_sha256.digest() == last.tokens_sha256:
                    known = last.digests
        if known is None:
            tokens_sha256 = hashlib.sha256()
            covered = 0
        tokens_sha256.update(packed[covered:])
        chained = chain_digests(packed[covered:], block_size, after=known[-1] if known else chain_start(salt))
        digests = PackedDigests.from_packed((known.packed if known else b"") + b"".join(chained))
        self._remember(conversation, _Hashed(salt, block_size, tokens_sha256.digest(), digests))
        return digests

    def _remember(self, conversation: tuple[str, str], hashed: _Hashed) -> None:
        size = _entry_bytes(hashed)
        if size > self._max_bytes:
            return
        self._entries[conversation] = hashed
        self._bytes += size
        while self._bytes > self._max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= _entry_bytes(dropped)


def _entry_bytes(hashed: _Hashed) -> int:
    return len(hashed.digests) * DIGEST_BYTES + _ENTRY_OVERHEAD_BYTES


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
