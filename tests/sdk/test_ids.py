"""The SDK checks conversation ids by the router's own rule, written twice because the SDK imports no
server code; this keeps the two equal."""

from __future__ import annotations

import pytest
from kvferry.runtime import ids as server_ids
from kvferry.sdk import _ids as sdk_ids


@pytest.mark.parametrize(
    "value",
    [
        "",
        "c-1",
        "tenant:conv.2_x",
        "a" * 128,
        "a" * 129,
        "has space",
        "slash/inside",
        "é",
        "c-1\n",
        "c-1\r\n",
    ],
)
def test_the_sdk_and_the_router_agree_on_every_id(value: str) -> None:
    assert sdk_ids.check_id("conversation_id", value) == server_ids.check_id("conversation_id", value)
    assert sdk_ids.MAX_ID_LENGTH == server_ids.MAX_ID_LENGTH
