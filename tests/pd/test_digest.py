"""PackedDigests: a digest chain held as one bytes object behaves as the sequence of its digests."""

from __future__ import annotations

import pytest
from kvferry.pd.digest import DIGEST_BYTES, PackedDigests, block_digests, matching_blocks


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


def test_packed_chains_match_as_far_as_their_digests_agree() -> None:
    history = list(range(200))
    chain = block_digests(history, 4)
    for edited_at in (None, 0, 3, 4, 101, 199):
        other = history.copy()
        if edited_at is not None:
            other[edited_at] = -1
        expected = 50 if edited_at is None else edited_at // 4
        theirs = block_digests(other, 4)
        assert matching_blocks(chain, theirs) == expected  # digest by digest
        assert matching_blocks(PackedDigests(chain), PackedDigests(theirs)) == expected
        assert matching_blocks(PackedDigests(chain)[:30], PackedDigests(theirs)) == min(expected, 30)
    assert matching_blocks(PackedDigests([]), PackedDigests(chain)) == 0
