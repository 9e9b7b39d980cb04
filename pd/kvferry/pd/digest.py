"""The block digest chain: one definition shared by the connector (which publishes it) and the
router (which checks a new prompt against it).

Digest ``i`` covers tokens ``[0, (i + 1) * block_size)``: it hashes digest ``i - 1`` with block
``i``'s token ids, so two sequences share digest ``i`` only if they share that whole prefix.
Only full blocks get a digest; reuse is therefore always block-aligned (rule 2 of docs/design.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_BYTES = 16
_CHAIN_VERSION = b"kvferry-digest-v1"


def block_digests(token_ids: Sequence[int], block_size: int, *, salt: str = "") -> list[bytes]:
    """Digests of every full block of ``token_ids``.

    ``salt`` binds the chain to a KV layout (e.g. the engines' compatibility hash), so
    digests from engines that cannot exchange KV never match.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    previous = hashlib.sha256(_CHAIN_VERSION + salt.encode()).digest()[:DIGEST_BYTES]
    digests: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        packed = struct.pack(f"<{block_size}q", *block)
        previous = hashlib.sha256(previous + packed).digest()[:DIGEST_BYTES]
        digests.append(previous)
    return digests


def matching_blocks(retained: Sequence[bytes], prompt: Sequence[bytes]) -> int:
    """How many leading blocks two digest chains share (the chain makes the first mismatch final)."""
    count = 0
    for a, b in zip(retained, prompt, strict=False):
        if a != b:
            break
        count += 1
    return count
