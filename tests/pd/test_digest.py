"""PackedDigests: a digest chain held as one bytes object behaves as the sequence of its digests."""

from __future__ import annotations

import pytest
from kvferry.pd.digest import DIGEST_BYTES, PackedDigests, block_digests


def test_a_slice_of_a_packed_chain_is_a_packed_chain_of_those_digests() -> None:
    chain = block_digests(list(range(64)), 4)
    packed = PackedDigests(chain)
    part = packed[3:9]
    assert isinstance(part, PackedDigests) and list(part) == chain[3:9]
    assert packed[-2:] == chain[-2:] and packed[9:3] == [] and len(packed[9:3]) == 0
    assert packed[::5] == chain[::5]


def test_a_chain_is_built_from_packed_bytes_only_whole_digests() -> None:
    chain = block_digests(list(range(12)), 4)
    assert PackedDigests.from_packed(b"".join(chain)) == chain
    with pytest.raises(ValueError, match=f"{DIGEST_BYTES} bytes per digest, not 17 bytes"):
        PackedDigests.from_packed(bytes(17))
