"""The endpoint picker against a real registry (real etcd) with real engines' records and retentions,
driven by an Envoy ext_proc client built from Envoy's published protos (the ``envoy-data-plane``
package's messages and its grpcio stub), in the two body modes a gateway uses: FULL_DUPLEX_STREAMED (the
Inference Extension's) and BUFFERED, plus headers-only requests.

No Envoy binary is reachable from these machines (docs/gateway.md): the client sends what Envoy sends, in
Envoy's order, and reads what Envoy would act on (header mutations, dynamic metadata, body mutations,
immediate responses).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import pytest_asyncio
from envoy_data_plane.envoy.config.core.v3 import HeaderMap, HeaderValue, Metadata
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as Mode
from envoy_data_plane.envoy.service.ext_proc.v3 import (
    ExternalProcessorSyncStub,
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
    ProtocolConfiguration,
)
from envoy_data_plane.google.protobuf import ListValue, Struct, Value
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.picker.server import PickerConfig, RunningPicker, start_picker
from kvferry.router.tenants import ApiKeys
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2 as resources

from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import publish, retention

KEY = "sk-picker-test"
TENANT = unique("tenant")
# A model of this module's own: the session's registry holds other tests' engines too.
MODEL = unique("model")
HASH = "picker-hash"


@dataclass(frozen=True)
class Engines:
    # Two decode engines: with equal load the picker takes the lower id ("a"), so a pick of "b" is affinity.
    decode_a: str
    decode_b: str
    prefill: str


def endpoint_of(engine_id: str) -> str:
    return {"a": "127.0.0.11:8000", "b": "127.0.0.12:8000", "p": "127.0.0.13:8000", "c": "127.0.0.14:8000"}[
        engine_id[-1]
    ]


async def register(registry: RegistryHandle, engine_id: str, role: resources.EngineRole.ValueType) -> None:
    await registry.stub().RegisterEngine(
        registry_pb2.RegisterEngineRequest(
            engine=resources.Engine(
                engine_id=engine_id,
                role=role,
                http_endpoint=f"http://{endpoint_of(engine_id)}",
                nixl_host="127.0.0.1",
                nixl_port=5600,
                model=MODEL,
                kv_compatibility_hash=HASH,
                block_size=16,
                kv_capacity_blocks=4096,
                max_model_len=8192,
            ),
            ttl_seconds=60,
        ),
        timeout=5,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engines(registry: RegistryHandle) -> Engines:
    base = unique("picker")
    found = Engines(decode_a=f"{base}-a", decode_b=f"{base}-b", prefill=f"{base}-p")
    await register(registry, found.decode_a, resources.ENGINE_ROLE_DECODE)
    await register(registry, found.decode_b, resources.ENGINE_ROLE_DECODE)
    await register(registry, found.prefill, resources.ENGINE_ROLE_PREFILL)
    return found


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def picker(registry: RegistryHandle, engines: Engines) -> AsyncIterator[RunningPicker]:
    running = await start_picker(
        PickerConfig(registry_address=registry.address, listen="127.0.0.1:0", max_body_bytes=4096),
        api_keys=ApiKeys.from_pairs([(KEY, TENANT)]),
    )
    await until(lambda: running.engines.get(engines.prefill) is not None)
    try:
        yield running
    finally:
        await running.stop(grace_seconds=0.5)


async def until(condition: object, within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# ---- the Envoy side -----------------------------------------------------------------------------


def request_headers(
    *, conversation: str | None = None, key: str | None = KEY, end_of_stream: bool = False
) -> list[HeaderValue]:
    headers = [
        HeaderValue(key=":method", raw_value=b"GET" if end_of_stream else b"POST"),
        HeaderValue(key=":path", raw_value=b"/v1/models" if end_of_stream else b"/v1/chat/completions"),
        HeaderValue(key="content-type", raw_value=b"application/json"),
    ]
    if key is not None:
        headers.append(HeaderValue(key="authorization", raw_value=f"Bearer {key}".encode()))
    if conversation is not None:
        headers.append(HeaderValue(key="x-conversation-id", raw_value=conversation.encode()))
    return headers


def chat_body(conversation: str | None = None) -> bytes:
    body: dict[str, object] = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}]}
    if conversation is not None:
        body["conversation_id"] = conversation
    return json.dumps(body).encode()


def envoy_messages(
    mode: Mode,
    headers: list[HeaderValue],
    body: bytes | None,
    *,
    chunk: int = 64,
    subset: Sequence[str] | None = None,
) -> list[ProcessingRequest]:
    """What Envoy sends for one request: the headers (with the protocol config, and the subset hint in the
    metadata context when given), then the body whole (BUFFERED) or in chunks (FULL_DUPLEX_STREAMED)."""
    metadata = None
    if subset is not None:
        hint = Struct(
            fields={
                "x-gateway-destination-endpoint-subset": Value(
                    list_value=ListValue(values=[Value(string_value=s) for s in subset])
                )
            }
        )
        metadata = Metadata(filter_metadata={"envoy.lb.subset_hint": hint})
    first = ProcessingRequest(
        request_headers=HttpHeaders(headers=HeaderMap(headers=headers), end_of_stream=body is None),
        metadata_context=metadata,
        protocol_config=ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )
    messages = [first]
    if body is None:
        return messages
    if mode == Mode.BUFFERED:
        return [*messages, ProcessingRequest(request_body=HttpBody(body=body, end_of_stream=True))]
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    for i, piece in enumerate(pieces):
        messages.append(
            ProcessingRequest(request_body=HttpBody(body=piece, end_of_stream=i == len(pieces) - 1))
        )
    return messages


@dataclass
class Answer:
    """What Envoy would act on, read from the picker's responses."""

    responses: list[ProcessingResponse]

    def mutation_headers(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for response in self.responses:
            common = None
            if response.request_headers is not None:
                common = response.request_headers.response
            elif response.request_body is not None:
                common = response.request_body.response
            if common is not None and common.header_mutation is not None:
                for option in common.header_mutation.set_headers:
                    assert option.header is not None
                    found[option.header.key] = option.header.raw_value.decode()
        return found

    @property
    def destination(self) -> str | None:
        return self.mutation_headers().get("x-gateway-destination-endpoint")

    def metadata_destination(self) -> str | None:
        for response in self.responses:
            if response.dynamic_metadata is not None:
                lb = response.dynamic_metadata.to_dict()["envoy.lb"]
                return str(lb["x-gateway-destination-endpoint"])
        return None

    def streamed_body(self) -> bytes:
        body = b""
        for response in self.responses:
            if response.request_body is not None and response.request_body.response is not None:
                mutation = response.request_body.response.body_mutation
                if mutation is not None and mutation.streamed_response is not None:
                    body += mutation.streamed_response.body
        return body

    @property
    def immediate(self) -> tuple[int, dict[str, object]] | None:
        for response in self.responses:
            if response.immediate_response is not None:
                status = response.immediate_response.status
                assert status is not None
                return int(status.code), json.loads(response.immediate_response.body)
        return None


async def send(picker: RunningPicker, messages: list[ProcessingRequest]) -> Answer:
    """One Process stream through the package's grpcio stub (in a thread: it is synchronous)."""

    def call() -> list[ProcessingResponse]:
        with grpc.insecure_channel(picker.address) as channel:
            return list(ExternalProcessorSyncStub(channel).process(iter(messages)))

    return Answer(await asyncio.to_thread(call))


def check_routed(answer: Answer, destination: str, engines: Engines, reason: str) -> None:
    assert answer.immediate is None, answer.immediate
    assert answer.destination == destination
    # The protocol's two forms must agree.
    assert answer.metadata_destination() == destination
    headers = answer.mutation_headers()
    assert headers["x-prefiller-host-port"] == endpoint_of(engines.prefill)
    assert headers["x-kvferry-pick-reason"] == reason


async def retain(registry: RegistryHandle, engine_id: str) -> str:
    conversation = unique("conv")
    await publish(registry.stub(), retention(TENANT, conversation, engine_id, ttl_seconds=60))
    return conversation


# ---- the tests ----------------------------------------------------------------------------------


async def test_a_known_conversation_goes_to_the_engine_holding_it(
    registry: RegistryHandle, engines: Engines, picker: RunningPicker
) -> None:
    conversation = await retain(registry, engines.decode_b)
    for mode in (Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED):
        # The id in the body (what the router's HTTP API reads).
        body = chat_body(conversation)
        answer = await send(picker, envoy_messages(mode, request_headers(), body))
        check_routed(answer, endpoint_of(engines.decode_b), engines, "retained")
        if mode == Mode.FULL_DUPLEX_STREAMED:
            assert answer.streamed_body() == body, "the body must reach the engine unchanged"
        # The id in the X-Conversation-Id header.
        answer = await send(
            picker, envoy_messages(mode, request_headers(conversation=conversation), chat_body())
        )
        check_routed(answer, endpoint_of(engines.decode_b), engines, "retained")


async def test_a_full_duplex_body_ended_by_trailers(
    registry: RegistryHandle, engines: Engines, picker: RunningPicker
) -> None:
    conversation = await retain(registry, engines.decode_b)
    body = chat_body(conversation)
    messages = envoy_messages(Mode.FULL_DUPLEX_STREAMED, request_headers(), body)
    last = messages[-1].request_body
    assert last is not None
    last.end_of_stream = False  # the trailers end the request instead
    messages.append(ProcessingRequest(request_trailers=HttpTrailers(trailers=HeaderMap(headers=[]))))
    answer = await send(picker, messages)
    check_routed(answer, endpoint_of(engines.decode_b), engines, "retained")
    assert answer.streamed_body() == body
    assert answer.responses[-1].request_trailers is not None


async def test_an_unknown_conversation_gets_a_load_aware_pick(
    engines: Engines, picker: RunningPicker
) -> None:
    for mode in (Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED):
        answer = await send(picker, envoy_messages(mode, request_headers(), chat_body(unique("conv"))))
        check_routed(answer, endpoint_of(engines.decode_a), engines, "no_retention")
    # Without a conversation, and headers only (GET /v1/models): a pick by load, no lookup, no key needed.
    answer = await send(picker, envoy_messages(Mode.BUFFERED, request_headers(key=None), chat_body()))
    check_routed(answer, endpoint_of(engines.decode_a), engines, "no_retention")
    answer = await send(
        picker, envoy_messages(Mode.FULL_DUPLEX_STREAMED, request_headers(end_of_stream=True), None)
    )
    assert answer.destination is not None and answer.metadata_destination() == answer.destination


async def test_a_conversation_whose_engine_is_gone_is_placed_by_load(
    registry: RegistryHandle, engines: Engines, picker: RunningPicker
) -> None:
    gone = engines.decode_a.removesuffix("-a") + "-c"
    await register(registry, gone, resources.ENGINE_ROLE_DECODE)
    conversation = await retain(registry, gone)
    await until(lambda: picker.engines.get(gone) is not None)
    answer = await send(picker, envoy_messages(Mode.BUFFERED, request_headers(), chat_body(conversation)))
    check_routed(answer, endpoint_of(gone), engines, "retained")

    await registry.stub().DeregisterEngine(registry_pb2.DeregisterEngineRequest(engine_id=gone), timeout=5)
    await until(lambda: picker.engines.get(gone) is None)
    for mode in (Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED):
        answer = await send(picker, envoy_messages(mode, request_headers(), chat_body(conversation)))
        # The registry ends a departed engine's retentions (no_retention); a lookup racing that end
        # still finds the record, whose holder the picker no longer has (holder_gone).
        reason = answer.mutation_headers().get("x-kvferry-pick-reason")
        assert reason in ("no_retention", "holder_gone")
        check_routed(answer, endpoint_of(engines.decode_a), engines, str(reason))


async def test_a_malformed_request_gets_a_clear_immediate_response(
    registry: RegistryHandle, engines: Engines, picker: RunningPicker
) -> None:
    cases: list[tuple[list[HeaderValue], bytes, int, str]] = [
        (request_headers(), b'{"model": "' + MODEL.encode() + b'", "messages": [', 400, "not JSON"),
        (request_headers(), b"[1, 2]", 400, "JSON object"),
        (
            request_headers(),
            json.dumps({"model": MODEL, "conversation_id": 7}).encode(),
            400,
            "must be a string",
        ),
        (request_headers(conversation="x"), chat_body("y"), 400, "differ"),
        (request_headers(), chat_body("bad id with spaces"), 400, "conversation_id"),
        (request_headers(), b"{" + b" " * 5000 + b"}", 400, "4096 bytes"),
        (request_headers(key=None), chat_body(unique("conv")), 401, "API key"),
        (request_headers(key="sk-wrong"), chat_body(unique("conv")), 401, "API key"),
        (request_headers(), json.dumps({"model": "no-such-model"}).encode(), 404, "no-such-model"),
    ]
    for mode in (Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED):
        for headers, body, status, words in cases:
            answer = await send(picker, envoy_messages(mode, headers, body))
            assert answer.immediate is not None, (body, answer.responses)
            code, error = answer.immediate
            assert code == status, (body, error)
            assert words in str(error["error"]), error  # OpenAI's error body, the router's wording
            assert answer.destination is None
    # The picker goes on serving.
    conversation = await retain(registry, engines.decode_b)
    answer = await send(
        picker, envoy_messages(Mode.FULL_DUPLEX_STREAMED, request_headers(), chat_body(conversation))
    )
    check_routed(answer, endpoint_of(engines.decode_b), engines, "retained")
    refused = picker.metrics.refusals.labels("400")._value.get()
    assert refused >= 12


async def test_the_gateway_subset_is_honoured(
    registry: RegistryHandle, engines: Engines, picker: RunningPicker
) -> None:
    conversation = await retain(registry, engines.decode_b)
    messages = envoy_messages(
        Mode.FULL_DUPLEX_STREAMED,
        request_headers(),
        chat_body(conversation),
        subset=[endpoint_of(engines.decode_a)],
    )
    answer = await send(picker, messages)
    check_routed(answer, endpoint_of(engines.decode_a), engines, "holder_not_candidate")
    # No eligible endpoint: 503, as the protocol says.
    answer = await send(
        picker, envoy_messages(Mode.BUFFERED, request_headers(), chat_body(conversation), subset=[])
    )
    assert answer.immediate is not None and answer.immediate[0] == 503


async def test_health_follows_the_inference_extension_names(picker: RunningPicker) -> None:
    async with grpc.aio.insecure_channel(picker.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
