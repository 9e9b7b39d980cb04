"""The one retry of optimistic etcd transactions (kvferry.registry.txn_retry): the registry's publishes and
turn marks go through it; their behaviour against a real etcd is in test_turns.py and test_retentions.py."""

from __future__ import annotations

import pytest
from kvferry.registry.txn_retry import TXN_ATTEMPTS, until_settled
from kvferry.runtime.errors import Aborted


async def test_the_first_settled_attempt_is_the_answer() -> None:
    outcomes = iter([None, None, "written"])
    calls = 0

    async def attempt() -> str | None:
        nonlocal calls
        calls += 1
        return next(outcomes)

    assert await until_settled(attempt, changed="conversation c") == "written"
    assert calls == 3


async def test_a_key_that_keeps_changing_is_aborted_naming_it_and_the_attempts() -> None:
    calls = 0

    async def attempt() -> str | None:
        nonlocal calls
        calls += 1
        return None

    with pytest.raises(Aborted) as aborted:
        await until_settled(attempt, changed="conversation c", doing=" while publishing")
    assert calls == TXN_ATTEMPTS
    assert (
        aborted.value.message
        == f"conversation c changed concurrently {TXN_ATTEMPTS} times while publishing; retry"
    )
