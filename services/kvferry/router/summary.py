"""A finished turn as the API's ``TurnSummary`` (the gRPC reply's last event; what telemetry records)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.router.cost import Reuse
from kvferry.v1 import router_service_pb2 as router_pb2

if TYPE_CHECKING:
    from kvferry.router.turns import TurnResult

REUSE_TO_PROTO = {
    Reuse.NONE: router_pb2.REUSE_DECISION_NONE,
    Reuse.PULL: router_pb2.REUSE_DECISION_PULL,
    Reuse.RECOMPUTE: router_pb2.REUSE_DECISION_RECOMPUTE,
}


def summary_proto(result: TurnResult) -> router_pb2.TurnSummary:
    return router_pb2.TurnSummary(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        pulled_tokens=result.pulled_tokens,
        recomputed_tokens=result.recomputed_tokens,
        ttft_ms=result.ttft_ms,
        prefill_ms=result.prefill_ms,
        reuse=REUSE_TO_PROTO[result.reuse],
        prefill_engine_id=result.prefill_engine_id,
        decode_engine_id=result.decode_engine_id,
        finish_reason=result.finish_reason,
        turn=result.turn,
    )
