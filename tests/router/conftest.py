"""Fixtures of the router's tests."""

from __future__ import annotations

import pytest
from kvferry.pd import digest


@pytest.fixture
def chained_blocks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many blocks each call of the router's prompt hashing chained (``PromptDigestCache``), in order."""
    chained: list[int] = []
    chain = digest.chain_digests

    def counted(packed: bytes | memoryview, block_size: int, *, after: bytes) -> list[bytes]:
        chained.append(len(packed) // (block_size * 8))
        return chain(packed, block_size, after=after)

    monkeypatch.setattr("kvferry.router.prefix.chain_digests", counted)
    return chained
