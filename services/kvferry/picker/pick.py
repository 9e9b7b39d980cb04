"""Which engines a gateway should send a turn to: pure, over the router's engine table.

The decode engine that holds the conversation's retained KV when it is registered, serves the model and
is among the gateway's candidates (affinity: only there can the turn reuse it); otherwise the least loaded
decode engine. The prefill engine is the least loaded one that can read the decode engine's KV layout.
Load is what engines last reported (``EngineStats``): the picker sends no work itself.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvferry.router.engines import (
    EngineInfo,
    EngineTable,
    LoadTracker,
    pick_decode_engine,
    pick_prefill_engine,
)
from kvferry.router.registry_client import RetentionRecord
from kvferry.runtime.errors import NotFound, Unavailable


class PickReason(enum.Enum):
    """Why the decode engine was chosen (the ``reason`` label of ``kvferry_picker_picks_total``)."""

    RETAINED = "retained"  # it holds the conversation's live retention
    NO_RETENTION = "no_retention"  # nothing retained (or no conversation id): least loaded
    HOLDER_GONE = "holder_gone"  # the holder is not registered any more: least loaded
    EXPIRED = "expired"  # the retention's lease ran out: least loaded
    HOLDER_NOT_CANDIDATE = "holder_not_candidate"  # the holder is outside the gateway's subset: least loaded


@dataclass(frozen=True)
class Pick:
    decode: EngineInfo
    prefill: EngineInfo | None
    reason: PickReason


def endpoint(engine: EngineInfo) -> str:
    """The engine's ``ip:port``, as the Inference Extension names endpoints."""
    return urlsplit(engine.http_endpoint).netloc or engine.http_endpoint


def choose(
    table: EngineTable,
    *,
    model: str,
    retention: RetentionRecord | None,
    now: float,
    subset: Collection[str] | None = None,
) -> Pick:
    """The engines for one turn. ``subset``: the endpoints the gateway allows (None: every engine).

    ``NotFound`` when no engine serves ``model``; ``Unavailable`` when no decode engine may take it.
    """
    if model and model not in table.models():
        raise NotFound(f"model {model!r} is not served; served: {table.models()}", param="model")
    decoders = [e for e in table.all() if e.can_decode and (not model or e.model == model)]
    if subset is not None:
        decoders = [e for e in decoders if endpoint(e) in subset]
    load = LoadTracker()
    reason, holder_id = _holder(table, retention, now, decoders)
    decode = pick_decode_engine(decoders, load, holder_id=holder_id)
    if decode is None:
        allowed = "" if subset is None else f" among the gateway's {len(subset)} candidate endpoints"
        raise Unavailable(f"no decode engine is ready{allowed}")
    prefillers = [e for e in table.prefill_engines(decode.model) if e.engine_id != decode.engine_id]
    prefill = pick_prefill_engine(prefillers, load, kv_compatibility_hash=decode.kv_compatibility_hash)
    return Pick(decode, prefill, reason)


def _holder(
    table: EngineTable, retention: RetentionRecord | None, now: float, decoders: list[EngineInfo]
) -> tuple[PickReason, str | None]:
    if retention is None:
        return PickReason.NO_RETENTION, None
    if table.get(retention.engine_id) is None:
        return PickReason.HOLDER_GONE, None
    if retention.expire_time <= now:
        return PickReason.EXPIRED, None
    if all(e.engine_id != retention.engine_id for e in decoders):
        return PickReason.HOLDER_NOT_CANDIDATE, None
    return PickReason.RETAINED, retention.engine_id
