"""SDK test fixtures: the stand-in RouterService (see standin_router.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sdk.standin_router import StandInRouter

API_KEY = "key-tenant-a"
OTHER_API_KEY = "key-tenant-b"


@pytest.fixture
def standin_router() -> Iterator[StandInRouter]:
    router = StandInRouter({API_KEY: "tenant-a", OTHER_API_KEY: "tenant-b"})
    router.start()
    yield router
    router.stop()
