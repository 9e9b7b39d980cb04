"""The only place SDK types meet protobuf: ``_to_proto`` / ``_from_proto`` converters."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2
from kvferry.sdk._models import (
    ChatMessage,
    Chunk,
    ConversationInfo,
    ReuseDecision,
    SamplingParams,
    TurnSummary,
)
from kvferry.v1 import router_service_pb2 as router_pb

# A prompt as the SDK holds it: raw text, token ids, or chat messages.
Prompt = str | tuple[int, ...] | tuple[ChatMessage, ...]

_REUSE_FROM_PROTO: dict[int, ReuseDecision] = {
    router_pb.REUSE_DECISION_UNSPECIFIED: ReuseDecision.UNSPECIFIED,
    router_pb.REUSE_DECISION_NONE: ReuseDecision.NONE,
    router_pb.REUSE_DECISION_PULL: ReuseDecision.PULL,
    router_pb.REUSE_DECISION_RECOMPUTE: ReuseDecision.RECOMPUTE,
    router_pb.REUSE_DECISION_LOCAL: ReuseDecision.LOCAL,
}


def sampling_to_proto(sampling: SamplingParams) -> router_pb.SamplingParams:
    return router_pb.SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        stop=list(sampling.stop),
        ignore_eos=sampling.ignore_eos,
    )


def generate_request_to_proto(
    conversation_id: str,
    prompt: Prompt,
    sampling: SamplingParams,
    *,
    model: str,
    retain: bool | None,
) -> router_pb.GenerateRequest:
    request = router_pb.GenerateRequest(
        conversation_id=conversation_id, model=model, sampling=sampling_to_proto(sampling)
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], ChatMessage):
        request.chat.CopyFrom(router_pb.ChatPrompt(messages=_messages_to_proto(prompt)))  # type: ignore[arg-type]
    else:
        request.tokens.CopyFrom(router_pb.TokenPrompt(token_ids=list(prompt)))  # type: ignore[arg-type]
    if retain is not None:
        request.retain = retain
    return request


def _messages_to_proto(messages: Sequence[ChatMessage]) -> list[router_pb.ChatMessage]:
    return [router_pb.ChatMessage(role=message.role, content=message.content) for message in messages]


def chunk_from_proto(delta: router_pb.TextDelta) -> Chunk:
    return Chunk(text=delta.text, token_ids=tuple(delta.token_ids))


def summary_from_proto(summary: router_pb.TurnSummary) -> TurnSummary:
    return TurnSummary(
        prompt_tokens=summary.prompt_tokens,
        completion_tokens=summary.completion_tokens,
        pulled_tokens=summary.pulled_tokens,
        recomputed_tokens=summary.recomputed_tokens,
        ttft_ms=summary.ttft_ms,
        prefill_ms=summary.prefill_ms,
        reuse=_REUSE_FROM_PROTO.get(summary.reuse, ReuseDecision.UNSPECIFIED),
        prefill_engine_id=summary.prefill_engine_id,
        decode_engine_id=summary.decode_engine_id,
        finish_reason=summary.finish_reason,
        turn=summary.turn,
    )


def timestamp_from_proto(timestamp: timestamp_pb2.Timestamp, present: bool) -> datetime | None:
    if not present:
        return None
    return datetime.fromtimestamp(timestamp.seconds + timestamp.nanos / 1e9, tz=UTC)


def conversation_info_from_proto(response: router_pb.GetConversationResponse) -> ConversationInfo:
    return ConversationInfo(
        conversation_id=response.conversation_id,
        turn=response.turn,
        num_tokens=response.num_tokens,
        engine_id=response.engine_id,
        expire_time=timestamp_from_proto(response.expire_time, response.HasField("expire_time")),
    )
