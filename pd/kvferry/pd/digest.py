"""The block digest chain: one definition shared by the connector (which publishes it) and the
router (which checks a new prompt against it).

Digest ``i`` covers tokens ``[0, (i + 1) * block_size)``: it hashes digest ``i - 1`` with block
``i``'s token ids, so two sequences share digest ``i`` only if they share that whole prefix.
Only full blocks get a digest; reuse is therefore always block-aligned (rule 2 of docs/design.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

DIGEST_BYTES = 16
_CHAIN_VERSION = b"kvferry-digest-v1"


def block_digests(token_ids: Sequence[int], block_size: int, *, salt: str = "") -> list[bytes]:
    """Digests of every full block of ``token_ids``.

    ``salt`` binds the chain to a KV layout (e.g. the engines' compatibility hash), so
    digests from engines that cannot exchange KV never match.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size * block_size
    return chain_digests(pack_token_ids(token_ids[:full]), block_size, after=chain_start(salt))


def chain_start(salt: str) -> bytes:
    """What the first block's digest hashes in place of a previous digest."""
    return hashlib.sha256(_CHAIN_VERSION + salt.encode()).digest()[:DIGEST_BYTES]


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as the chain hashes them: 8 bytes each, little-endian (all at once: one C call)."""
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


def chain_digests(packed: bytes | memoryview, block_size: int, *, after: bytes) -> list[bytes]:
    """The digests of the full blocks of ``packed`` (:func:`pack_token_ids`), chained on from ``after`` (the
    digest of the block before them, or :func:`chain_start`)."""
    previous = after
    digests: list[bytes] = []
    step = block_size * 8
    sha256 = hashlib.sha256
    for start in range(0, len(packed) // step * step, step):
        previous = sha256(previous + packed[start : start + step]).digest()[:DIGEST_BYTES]
        digests.append(previous)
    return digests


def matching_blocks(retained: Sequence[bytes], prompt: Sequence[bytes]) -> int:
    """How many leading blocks two digest chains share (the chain makes the first mismatch final)."""
    if isinstance(retained, PackedDigests) and isinstance(prompt, PackedDigests):
        return _common_blocks(retained.packed, prompt.packed)
    count = 0
    for a, b in zip(retained, prompt, strict=False):
        if a != b:
            break
        count += 1
    return count


def _common_blocks(a: bytes, b: bytes) -> int:
    """:func:`matching_blocks` of two packed chains: their bytes compared (at C speed), halving the range
    until the first digest that differs, instead of one digest at a time."""
    same, differs = 0, min(len(a), len(b)) // DIGEST_BYTES
    if a[: differs * DIGEST_BYTES] == b[: differs * DIGEST_BYTES]:
        return differs
    # a[:same] equals b[:same] and a[:differs] does not (in digests).
    while differs - same > 1:
        middle = (same + differs) // 2
        if a[: middle * DIGEST_BYTES] == b[: middle * DIGEST_BYTES]:
            same = middle
        else:
            differs = middle
    return same


class PackedDigests(Sequence[bytes]):
    """A digest chain held as one bytes object, ``DIGEST_BYTES`` per block: what an index that holds many
    chains keeps (a tuple of bytes objects costs ~57 bytes per digest, this 16)."""

    __slots__ = ("_packed",)

    def __init__(self, digests: Iterable[bytes]) -> None:
        chain = list(digests)
        if any(len(digest) != DIGEST_BYTES for digest in chain):
            raise ValueError(f"every digest of a chain is {DIGEST_BYTES} bytes")
        self._packed = b"".join(chain)

    @classmethod
    def from_packed(cls, packed: bytes) -> PackedDigests:
        """The chain ``packed`` holds, ``DIGEST_BYTES`` per block, kept as it is (no copy)."""
        if len(packed) % DIGEST_BYTES:
            raise ValueError(f"a packed chain is {DIGEST_BYTES} bytes per digest, not {len(packed)} bytes")
        chain = cls.__new__(cls)
        chain._packed = packed
        return chain

    @property
    def packed(self) -> bytes:
        """The chain as one bytes object, ``DIGEST_BYTES`` per block."""
        return self._packed

    def __len__(self) -> int:
        return len(self._packed) // DIGEST_BYTES

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return PackedDigests.from_packed(
                self._packed[start * DIGEST_BYTES : max(start, stop) * DIGEST_BYTES]
            )
        count = len(self)
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError("digest index out of range")
        return self._packed[index * DIGEST_BYTES : (index + 1) * DIGEST_BYTES]

    def __iter__(self) -> Iterator[bytes]:
        packed = self._packed
        return (packed[start : start + DIGEST_BYTES] for start in range(0, len(packed), DIGEST_BYTES))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedDigests):
            return self._packed == other._packed
        if isinstance(other, Sequence):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._packed)

    def __repr__(self) -> str:
        return f"PackedDigests({len(self)} digests)"
