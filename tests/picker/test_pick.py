"""The picker's choice, table by table (pure: an engine table, a retention, a clock)."""

from __future__ import annotations

import pytest
from kvferry.picker.pick import PickReason, choose, endpoint
from kvferry.router.engines import EngineInfo, EngineStats, EngineTable
from kvferry.router.registry_client import RetentionRecord
from kvferry.runtime.errors import NotFound, Unavailable
from kvferry.v1 import resources_pb2

NOW = 1000.0


def engine(
    engine_id: str, role: int, *, running: int = 0, model: str = "m", kv_hash: str = "h"
) -> EngineInfo:
    return EngineInfo(
        engine_id=engine_id,
        role=role,
        http_endpoint=f"http://10.0.0.{ord(engine_id[-1]) % 250}:8000",
        nixl_host="10.0.0.1",
        nixl_port=5600,
        model=model,
        kv_compatibility_hash=kv_hash,
        block_size=16,
        max_model_len=8192,
        stats=EngineStats(running_requests=running, inflight_prefill_tokens=running * 100),
    )


DECODE, PREFILL = resources_pb2.ENGINE_ROLE_DECODE, resources_pb2.ENGINE_ROLE_PREFILL
TABLE = EngineTable(
    [
        engine("d1", DECODE, running=9),  # busy, holds the conversation
        engine("d2", DECODE, running=1),
        engine("p1", PREFILL, running=5),
        engine("p2", PREFILL, running=0),
        engine("p3", PREFILL, kv_hash="other"),  # cannot read d1/d2's KV
        engine("x1", DECODE, model="other-model"),
    ]
)


def held_by(engine_id: str, *, expire: float = NOW + 60) -> RetentionRecord:
    return RetentionRecord("t", "c", engine_id, "r", (1, 2), 32, (b"a", b"b"), 1, expire)


@pytest.mark.parametrize(
    ("retention", "subset", "decode", "reason"),
    [
        (held_by("d1"), None, "d1", PickReason.RETAINED),  # affinity beats load
        (None, None, "d2", PickReason.NO_RETENTION),  # least loaded
        (held_by("gone"), None, "d2", PickReason.HOLDER_GONE),
        (held_by("d1", expire=NOW), None, "d2", PickReason.EXPIRED),
        (held_by("d1"), {"10.0.0.50:8000"}, "d2", PickReason.HOLDER_NOT_CANDIDATE),
    ],
)
def test_decode_choice(
    retention: RetentionRecord | None, subset: set[str] | None, decode: str, reason: PickReason
) -> None:
    pick = choose(TABLE, model="m", retention=retention, now=NOW, subset=subset)
    assert (pick.decode.engine_id, pick.reason) == (decode, reason)
    # The least loaded prefill engine that reads the decode engine's KV layout.
    assert pick.prefill is not None and pick.prefill.engine_id == "p2"


def test_endpoints_are_ip_port() -> None:
    assert endpoint(TABLE.get("d2")) == "10.0.0.50:8000"  # type: ignore[arg-type]


def test_refusals() -> None:
    with pytest.raises(NotFound, match="not served"):
        choose(TABLE, model="nope", retention=None, now=NOW)
    with pytest.raises(Unavailable, match="candidate"):
        choose(TABLE, model="m", retention=None, now=NOW, subset=set())
    assert choose(TABLE, model="other-model", retention=None, now=NOW).prefill is None
