"""The start-up warning that a fenced pull fails its request unless vLLM recomputes: only on an engine that
pulls retentions (a prefill), never on a decode engine (its P->D pulls are not fenced)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from kvferry.connector.connector import warn_when_fenced_pulls_fail_requests
from kvferry.connector.settings import KvferrySettings
from vllm.config import KVTransferConfig

WARNING = "a fenced pull fails its request"


def _transfer(kv_role: str, policy: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KvferryConnector",
        kv_role=kv_role,  # type: ignore[arg-type]
        engine_id="e-0",
        kv_load_failure_policy=policy,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("kv_role", "policy", "fence_pulls", "warned"),
    [
        ("kv_producer", "fail", True, True),
        ("kv_both", "fail", True, True),
        ("kv_consumer", "fail", True, False),  # the decode engine: its pulls are never fenced
        ("kv_producer", "recompute", True, False),
        ("kv_producer", "fail", False, False),
    ],
)
def test_only_an_engine_whose_fenced_pulls_would_fail_is_warned(
    kv_role: str, policy: str, fence_pulls: bool, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    settings = dataclasses.replace(KvferrySettings(), fence_pulls=fence_pulls)
    with caplog.at_level(logging.WARNING, logger="kvferry.connector"):
        warn_when_fenced_pulls_fail_requests(settings, _transfer(kv_role, policy))
    assert any(WARNING in record.getMessage() for record in caplog.records) == warned, caplog.text
