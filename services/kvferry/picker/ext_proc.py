"""Envoy's external processing protocol (``envoy.service.ext_proc.v3.ExternalProcessor/Process``) as the
Gateway API Inference Extension's endpoint picker speaks it (its "Endpoint Picker Protocol").

One ``Process`` stream is one HTTP request. The picker reads the request's headers and, when the gateway
sends it, its body; decides once (:func:`kvferry.picker.pick.choose`); and answers with the
``x-gateway-destination-endpoint`` header plus the same endpoint in the dynamic metadata namespace
``envoy.lb``, and llm-d's ``x-prefiller-host-port`` naming the prefill engine. Body modes:

- ``FULL_DUPLEX_STREAMED`` (what the Inference Extension configures): body chunks arrive without waiting
  for the headers' answer; the picker holds the headers' answer until the body's end, then sends it and
  the whole body back as one streamed body mutation.
- ``BUFFERED``: the headers are let through, the whole body arrives in one message, and the destination
  goes in the body's answer.
- ``NONE`` / ``STREAMED``: the picker decides from the headers alone (``X-Conversation-Id``); body
  chunks pass unchanged.

A request the picker refuses ends with an immediate response: the status of the kit's table and
OpenAI's error body (400 malformed or too large a body, 401 no or unknown API key, 403 a model the
tenant may not use, 404 unknown model, 503 no engine); the stream, and the picker, go on serving others.
Messages are the ``envoy-data-plane`` package's (betterproto2); grpc.aio serves them through a generic
handler.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc
from envoy_data_plane.envoy.config.core.v3 import (
    HeaderValue,
    HeaderValueOption,
    HeaderValueOptionHeaderAppendAction,
)
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    HttpBody,
    HttpHeaders,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy_data_plane.envoy.type.v3 import HttpStatus, StatusCode
from envoy_data_plane.google.protobuf import ListValue, Struct, Value
from kvferry.picker.pick import Pick, PickReason, choose, endpoint
from kvferry.picker.request import request_identity
from kvferry.router.engines import EngineTable
from kvferry.router.http_api import error_response
from kvferry.router.registry_client import RegistryUnavailable, RetentionRecord
from kvferry.router.tenants import ApiKeys
from kvferry.runtime.errors import InvalidArgument, ServiceError, http_status, internal_error

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
# llm-d's P/D header: the decode endpoint's routing sidecar prefills there first.
PREFILLER_HEADER = "x-prefiller-host-port"
REASON_HEADER = "x-kvferry-pick-reason"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"

_Mode = ProcessingModeBodySendMode
_OVERWRITE = HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


class RetentionLookup(Protocol):
    async def get_retention(self, tenant: str, conversation_id: str) -> RetentionRecord | None: ...


class PickCounter(Protocol):
    def picked(self, reason: PickReason, seconds: float) -> None: ...

    def refused(self, status: int) -> None: ...


class _Refused(Exception):
    """Ends a stream with an immediate response."""

    def __init__(self, error: ServiceError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclasses.dataclass
class _Stream:
    """One HTTP request's state across its Process stream."""

    request_mode: _Mode = _Mode.NONE
    response_mode: _Mode = _Mode.NONE
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    subset: frozenset[str] | None = None
    body: bytearray = dataclasses.field(default_factory=bytearray)
    decided: bool = False


class ExtProcPicker:
    """The ``Process`` handler (:meth:`process`), over the router's engine table and registry client."""

    def __init__(
        self,
        *,
        engines: EngineTable,
        registry: RetentionLookup,
        keys: ApiKeys,
        metrics: PickCounter,
        max_body_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._engines = engines
        self._registry = registry
        self._keys = keys
        self._metrics = metrics
        self._max_body_bytes = max_body_bytes
        self._clock = clock

    async def process(
        self, requests: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        stream = _Stream()
        try:
            async for message in requests:
                for response in await self._answer(stream, message):
                    yield response
        except _Refused as refusal:
            status = http_status(refusal.error)
            self._metrics.refused(status)
            log.info("request refused", extra={"status": status, "error": refusal.error.message})
            yield _immediate(refusal.error, status)

    async def _answer(self, stream: _Stream, message: ProcessingRequest) -> list[ProcessingResponse]:
        if message.protocol_config is not None:
            stream.request_mode = message.protocol_config.request_body_mode
            stream.response_mode = message.protocol_config.response_body_mode
        if message.request_headers is not None:
            return await self._on_request_headers(stream, message.request_headers, message)
        if message.request_body is not None:
            return await self._on_request_body(stream, message.request_body)
        if message.request_trailers is not None:
            trailers = [ProcessingResponse(request_trailers=TrailersResponse())]
            if stream.decided or stream.request_mode != _Mode.FULL_DUPLEX_STREAMED:
                return trailers
            # Trailers end a full-duplex body that ended without end_of_stream: decide now.
            return [*_held_request(await self._decide(stream), stream, end_of_stream=False), *trailers]
        if message.response_headers is not None:
            return [ProcessingResponse(response_headers=HeadersResponse())]
        if message.response_body is not None:
            return [_pass_body(message.response_body, stream.response_mode, request=False)]
        if message.response_trailers is not None:
            return [ProcessingResponse(response_trailers=TrailersResponse())]
        return []

    async def _on_request_headers(
        self, stream: _Stream, headers: HttpHeaders, message: ProcessingRequest
    ) -> list[ProcessingResponse]:
        for header in headers.headers.headers if headers.headers else []:
            stream.headers[header.key.lower()] = header.value or header.raw_value.decode("utf-8", "replace")
        stream.subset = _subset(message)
        if headers.end_of_stream or stream.request_mode in (_Mode.NONE, _Mode.STREAMED):
            pick = await self._decide(stream)
            return [_headers_answer(pick)]
        if stream.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return []  # the headers' answer waits for the body
        return [ProcessingResponse(request_headers=HeadersResponse())]

    async def _on_request_body(self, stream: _Stream, body: HttpBody) -> list[ProcessingResponse]:
        if stream.decided:
            return [_pass_body(body, stream.request_mode, request=True)]
        stream.body += body.body
        if len(stream.body) > self._max_body_bytes:
            raise _Refused(
                InvalidArgument(f"the request body is over {self._max_body_bytes} bytes, the picker's limit")
            )
        if not body.end_of_stream:
            return []
        pick = await self._decide(stream)
        if stream.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return _held_request(pick, stream, end_of_stream=True)
        return [
            ProcessingResponse(
                request_body=BodyResponse(response=_route_to(pick)), dynamic_metadata=_lb_metadata(pick)
            )
        ]

    async def _decide(self, stream: _Stream) -> Pick:
        started = time.perf_counter()
        try:
            identity = request_identity(stream.headers, bytes(stream.body))
            retention = None
            if identity.conversation_id is not None:
                tenant = self._keys.authenticate(identity.authorization)
                if identity.model:
                    tenant.check_model(identity.model)
                retention = await self._lookup(tenant.name, identity.conversation_id)
            pick = choose(
                self._engines,
                model=identity.model,
                retention=retention,
                now=self._clock(),
                subset=stream.subset,
            )
        except ServiceError as error:
            raise _Refused(error) from None
        except Exception as error:
            raise _Refused(internal_error(error, "picker", "pick")) from None
        stream.decided = True
        self._metrics.picked(pick.reason, time.perf_counter() - started)
        log.debug(
            "picked",
            extra={
                "decode": pick.decode.engine_id,
                "prefill": pick.prefill.engine_id if pick.prefill else None,
                "reason": pick.reason.value,
            },
        )
        return pick

    async def _lookup(self, tenant: str, conversation_id: str) -> RetentionRecord | None:
        try:
            return await self._registry.get_retention(tenant, conversation_id)
        except RegistryUnavailable as error:
            # Rule 7 of docs/design.md: without the registry the turn still goes somewhere, by load.
            log.warning("registry unavailable; picking by load", extra={"error": str(error)})
            return None


def add_to_server(picker: ExtProcPicker, server: grpc.aio.Server) -> None:
    """Registers :class:`ExtProcPicker` (a ``ServiceBinding`` function for the service kit)."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Process": grpc.stream_stream_rpc_method_handler(
                picker.process,
                request_deserializer=ProcessingRequest.parse,
                response_serializer=bytes,
            )
        },
    )
    server.add_generic_rpc_handlers((handler,))


def _set(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE)


def _route_to(pick: Pick) -> CommonResponse:
    set_headers = [_set(DESTINATION_HEADER, endpoint(pick.decode)), _set(REASON_HEADER, pick.reason.value)]
    remove: list[str] = []
    if pick.prefill is not None:
        set_headers.append(_set(PREFILLER_HEADER, endpoint(pick.prefill)))
    else:
        remove.append(PREFILLER_HEADER)  # never pass on a client's own
    return CommonResponse(
        header_mutation=HeaderMutation(set_headers=set_headers, remove_headers=remove),
        # The route was chosen before the destination was known.
        clear_route_cache=True,
    )


def _lb_metadata(pick: Pick) -> Struct:
    chosen = Struct(fields={DESTINATION_HEADER: Value(string_value=endpoint(pick.decode))})
    return Struct(fields={LB_NAMESPACE: Value(struct_value=chosen)})


def _headers_answer(pick: Pick) -> ProcessingResponse:
    return ProcessingResponse(
        request_headers=HeadersResponse(response=_route_to(pick)), dynamic_metadata=_lb_metadata(pick)
    )


def _held_request(pick: Pick, stream: _Stream, *, end_of_stream: bool) -> list[ProcessingResponse]:
    """Full duplex: the headers' answer held until the body was read, then the whole body, unchanged."""
    whole = StreamedBodyResponse(body=bytes(stream.body), end_of_stream=end_of_stream)
    body = BodyResponse(response=CommonResponse(body_mutation=BodyMutation(streamed_response=whole)))
    return [_headers_answer(pick), ProcessingResponse(request_body=body)]


def _pass_body(body: HttpBody, mode: _Mode, *, request: bool) -> ProcessingResponse:
    """A body chunk let through unchanged (in full-duplex mode it must be sent back)."""
    answer = BodyResponse()
    if mode == _Mode.FULL_DUPLEX_STREAMED:
        chunk = StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
        answer = BodyResponse(response=CommonResponse(body_mutation=BodyMutation(streamed_response=chunk)))
    return ProcessingResponse(request_body=answer) if request else ProcessingResponse(response_body=answer)


def _subset(message: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway allows (``envoy.lb.subset_hint``), or None when it sets none."""
    if message.metadata_context is None:
        return None
    hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET_KEY not in hint.fields:
        return None
    values: ListValue | None = hint.fields[SUBSET_KEY].list_value
    if values is None:
        return frozenset()
    return frozenset(v.string_value for v in values.values if v.string_value)


def _immediate(error: ServiceError, status: int) -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=StatusCode(status)),
            headers=HeaderMutation(set_headers=[_set("content-type", "application/json")]),
            body=bytes(error_response(error).body),
            details=f"kvferry picker: {error.message}"[:1024],
        )
    )
