"""Fuzzed input to the router (HTTP and gRPC) and the registry: nothing a client sends gets a 5xx
(HTTP) or INTERNAL / UNKNOWN (gRPC); bad input is refused with 400 / INVALID_ARGUMENT.

Real registry (real etcd), real router, stand-in engines (tests/faults/conftest.py).
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.faults.conftest import FUZZ_MODEL, ServicesOnThread

API_KEY = "key-acme"
AUTH = {"authorization": f"Bearer {API_KEY}"}
FUZZ = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
# gRPC codes a client's input may earn; INTERNAL, UNKNOWN, UNAVAILABLE and DEADLINE_EXCEEDED would be
# the server's fault (every service is up).
CLIENT_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# -- values a careless or hostile client sends ---------------------------------------------------------

EDGE_INTS = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30])
INTS = st.one_of(EDGE_INTS, st.integers(min_value=-1000, max_value=1000))
EDGE_TEXT = st.sampled_from(
    ["", "a", "conv-1\n", "conv-1\r\n", "\n", "a" * 129, "a/b", "é", "\x00", " ", "tiny", FUZZ_MODEL]
)
TEXT = st.one_of(EDGE_TEXT, st.text(max_size=40))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
TOKEN_LISTS = st.lists(st.one_of(INTS, st.integers(min_value=10, max_value=300)), min_size=0, max_size=40)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "robot", ""]), TEXT)},
        optional={
            "content": st.one_of(
                TEXT,
                st.none(),
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image_url", ""])},
                        optional={"text": st.one_of(TEXT, INTS)},
                    ),
                    max_size=3,
                ),
            )
        },
    ),
    max_size=4,
)


def _field_values(name: str) -> st.SearchStrategy[Any]:
    typed: dict[str, st.SearchStrategy[Any]] = {
        "max_tokens": st.one_of(INTS, st.integers(1, 16)),
        "max_completion_tokens": st.one_of(INTS, st.integers(1, 16)),
        "temperature": st.one_of(st.floats(-1, 20, allow_nan=False), INTS),
        "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), INTS),
        "seed": INTS,
        "n": INTS,
        "stop": st.one_of(TEXT, st.lists(TEXT, max_size=20)),
        "conversation_id": TEXT,
        "model": st.one_of(st.just(FUZZ_MODEL), TEXT),
        "stream": st.booleans(),
        "retain": st.booleans(),
        "ignore_eos": st.booleans(),
        "prompt": st.one_of(TOKEN_LISTS, TEXT, st.lists(TOKEN_LISTS, max_size=2), st.lists(TEXT, max_size=2)),
        "messages": MESSAGES,
        "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": SCALARS})),
        "logprobs": SCALARS,
    }
    return st.one_of(typed[name], JSON_VALUES) if name in typed else JSON_VALUES


COMMON_FIELDS = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "retain",
    "conversation_id",
    "ignore_eos",
    "stream_options",
    "logprobs",
)


@st.composite
def http_bodies(draw: st.DrawFn, kind: str) -> dict[str, Any]:
    """A request that starts valid and has some fields replaced, dropped or added."""
    body: dict[str, Any] = {"model": FUZZ_MODEL, "max_tokens": 4}
    fields: tuple[str, ...]
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hello"}]
        fields = (*COMMON_FIELDS, "messages", "max_completion_tokens")
    else:
        body["prompt"] = [40, 41, 42, 43]
        fields = (*COMMON_FIELDS, "prompt")
    for name in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        if draw(st.booleans()):
            body[name] = draw(_field_values(name))
        else:
            body.pop(name, None)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(max_size=10))] = draw(JSON_VALUES)
    return body


def _check_http(client: httpx.Client, path: str, content: bytes, headers: dict[str, str]) -> httpx.Response:
    response = client.post(path, content=content, headers={**AUTH, **headers})
    assert response.status_code < 500, (response.status_code, content[:300], response.text[:300])
    if response.status_code == 200 and response.headers.get("content-type", "").startswith(
        "text/event-stream"
    ):
        for line in response.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                code = json.loads(line[6:])["error"]["code"]
                assert not (isinstance(code, int) and code >= 500), (content[:300], line)
    return response


# -- HTTP ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def http(services: ServicesOnThread) -> Any:
    with httpx.Client(base_url=services.router.http_url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("kind,path", [("chat", "/v1/chat/completions"), ("completion", "/v1/completions")])
def test_fuzzed_http_bodies_never_get_a_5xx(http: httpx.Client, kind: str, path: str) -> None:
    @FUZZ
    @given(body=http_bodies(kind))
    def check(body: dict[str, Any]) -> None:
        _check_http(http, path, json.dumps(body).encode(), {"content-type": "application/json"})

    check()


def test_fuzzed_raw_bytes_never_get_a_5xx(http: httpx.Client) -> None:
    @FUZZ
    @given(
        raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
        path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    )
    def check(raw: bytes, path: str) -> None:
        _check_http(http, path, raw, {"content-type": "application/json"})

    check()


@pytest.mark.parametrize("token", [2**63, 2**63 + 1, 2**64, 10**30, -1, -(2**63), 2**31])
def test_token_ids_out_of_range_are_400(http: httpx.Client, token: int) -> None:
    body = {"model": FUZZ_MODEL, "prompt": [40, token, 42], "max_tokens": 2}
    response = _check_http(http, "/v1/completions", json.dumps(body).encode(), {})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("conversation", ["conv-1\n", "conv-1\r\n", "\nconv-1", "conv 1"])
def test_conversation_ids_with_a_newline_are_400(http: httpx.Client, conversation: str) -> None:
    body = {"model": FUZZ_MODEL, "prompt": [40, 41, 42], "max_tokens": 2, "conversation_id": conversation}
    response = _check_http(http, "/v1/completions", json.dumps(body).encode(), {})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "conversation_id"


@pytest.mark.parametrize(
    "field,value",
    [("stream", "yes"), ("retain", "no"), ("max_tokens", "2"), ("seed", "7"), ("temperature", "0.5")],
)
def test_strings_are_not_coerced_to_booleans_or_numbers(http: httpx.Client, field: str, value: str) -> None:
    body = {"model": FUZZ_MODEL, "prompt": [40, 41, 42], "max_tokens": 2, field: value}
    response = _check_http(http, "/v1/completions", json.dumps(body).encode(), {})
    assert response.status_code == 400, response.text


@pytest.mark.parametrize("field,value", [("seed", 2**63), ("seed", -(2**63) - 1), ("max_tokens", 2**31)])
def test_numbers_beyond_the_engines_range_are_400(http: httpx.Client, field: str, value: int) -> None:
    body = {"model": FUZZ_MODEL, "prompt": [40, 41, 42], "max_tokens": 2, field: value}
    response = _check_http(http, "/v1/completions", json.dumps(body).encode(), {})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


# -- router gRPC ---------------------------------------------------------------------------------------

INT64 = st.one_of(
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1)
)
INT32 = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))


@st.composite
def generate_requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(
        conversation_id=draw(st.one_of(st.just("conv-fuzz"), TEXT)),
        model=draw(st.one_of(st.just(FUZZ_MODEL), TEXT)),
    )
    kind = draw(st.sampled_from(["tokens", "text", "chat", "none"]))
    if kind == "tokens":
        request.tokens.token_ids.extend(draw(st.lists(st.one_of(INT64, st.integers(10, 300)), max_size=30)))
    elif kind == "text":
        request.text = draw(TEXT)
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(st.one_of(st.just("user"), TEXT), TEXT), max_size=3)):
            request.chat.messages.add(role=role, content=content)
    request.sampling.max_tokens = draw(st.one_of(st.integers(0, 8), INT32))
    request.sampling.temperature = draw(st.floats(-1, 20, allow_nan=False, width=32))
    request.sampling.top_p = draw(st.floats(-1, 2, allow_nan=False, width=32))
    request.sampling.seed = draw(INT64)
    request.sampling.stop.extend(draw(st.lists(TEXT, max_size=3)))
    return request


def test_fuzzed_generate_calls_never_fail_inside_the_router(services: ServicesOnThread) -> None:
    with grpc.insecure_channel(services.router.grpc_address) as channel:
        stub = router_grpc.RouterServiceStub(channel)

        @FUZZ
        @given(request=generate_requests())
        def check(request: router_pb2.GenerateRequest) -> None:
            try:
                for _ in stub.Generate(
                    request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=30
                ):
                    pass
            except grpc.RpcError as error:
                assert error.code() in CLIENT_CODES, (request, error.code(), error.details())

        check()


def test_grpc_token_ids_out_of_range_are_invalid_argument(services: ServicesOnThread) -> None:
    with grpc.insecure_channel(services.router.grpc_address) as channel:
        stub = router_grpc.RouterServiceStub(channel)
        for token in (-1, 2**31, 2**63 - 1, -(2**63)):
            request = router_pb2.GenerateRequest(conversation_id="conv-range", model=FUZZ_MODEL)
            request.tokens.token_ids.extend([40, token, 42])
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(request, metadata=(("authorization", f"Bearer {API_KEY}"),), timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- registry gRPC -------------------------------------------------------------------------------------

DIGESTS = st.lists(st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20)), max_size=4)


@st.composite
def retentions(draw: st.DrawFn) -> resources_pb2.Retention:
    return resources_pb2.Retention(
        tenant=draw(st.one_of(st.just("acme"), TEXT)),
        conversation_id=draw(st.one_of(st.just("conv-fuzz"), TEXT)),
        engine_id=draw(st.one_of(st.just("engine-fuzz"), TEXT)),
        engine_request_id=draw(st.one_of(st.just("req-1"), TEXT)),
        block_ids=draw(st.lists(INT64, max_size=4)),
        num_tokens=draw(st.one_of(st.integers(0, 64), INT64)),
        block_digests=draw(DIGESTS),
        turn=draw(st.one_of(st.integers(0, 4), INT64)),
        ttl_seconds=draw(st.one_of(st.integers(0, 100), INT64)),
    )


@st.composite
def engines(draw: st.DrawFn) -> resources_pb2.Engine:
    return resources_pb2.Engine(
        engine_id=draw(st.one_of(st.just("engine-fuzz"), TEXT)),
        role=draw(st.integers(-1, 5)),  # type: ignore[arg-type]
        http_endpoint=draw(st.one_of(st.just("http://127.0.0.1:1"), TEXT)),
        nixl_host=draw(TEXT),
        nixl_port=draw(INT32),
        model=draw(TEXT),
        kv_compatibility_hash=draw(TEXT),
        block_size=draw(st.one_of(st.just(16), INT32)),
        kv_capacity_blocks=draw(INT64),
        max_model_len=draw(INT32),
    )


def _registry_calls(stub: registry_grpc.RegistryServiceStub) -> st.SearchStrategy[Any]:
    """(method, request) pairs over every unary RPC of the registry."""
    conversation = st.tuples(st.one_of(st.just("acme"), TEXT), st.one_of(st.just("conv-fuzz"), TEXT))
    return st.one_of(
        st.builds(
            lambda e, t: (stub.RegisterEngine, registry_pb2.RegisterEngineRequest(engine=e, ttl_seconds=t)),
            engines(),
            INT64,
        ),
        st.builds(lambda i: (stub.HeartbeatEngine, registry_pb2.HeartbeatEngineRequest(engine_id=i)), TEXT),
        st.builds(lambda i: (stub.DeregisterEngine, registry_pb2.DeregisterEngineRequest(engine_id=i)), TEXT),
        st.builds(
            lambda size, token: (
                stub.ListEngines,
                registry_pb2.ListEnginesRequest(page_size=size, page_token=token),
            ),
            INT32,
            st.one_of(TEXT, st.binary(max_size=12).map(lambda b: b.hex())),
        ),
        st.builds(
            lambda r: (stub.PublishRetention, registry_pb2.PublishRetentionRequest(retention=r)), retentions()
        ),
        st.builds(
            lambda c: (
                stub.GetRetention,
                registry_pb2.GetRetentionRequest(tenant=c[0], conversation_id=c[1]),
            ),
            conversation,
        ),
        st.builds(
            lambda c: (
                stub.RenewRetention,
                registry_pb2.RenewRetentionRequest(tenant=c[0], conversation_id=c[1]),
            ),
            conversation,
        ),
        st.builds(
            lambda c, reason: (
                stub.ReleaseRetention,
                registry_pb2.ReleaseRetentionRequest(tenant=c[0], conversation_id=c[1], reason=reason),
            ),
            conversation,
            st.integers(-1, 9),
        ),
    )


def test_fuzzed_registry_calls_never_fail_inside_the_registry(services: ServicesOnThread) -> None:
    with grpc.insecure_channel(services.registry.address) as channel:
        stub = registry_grpc.RegistryServiceStub(channel)

        @FUZZ
        @given(call=_registry_calls(stub))
        def check(call: Any) -> None:
            method, request = call
            try:
                method(request, timeout=10)
            except grpc.RpcError as error:
                assert error.code() in CLIENT_CODES, (request, error.code(), error.details())

        check()


@pytest.mark.parametrize("field", ["tenant", "conversation_id", "engine_id", "engine_request_id"])
def test_registry_ids_with_a_trailing_newline_are_invalid_argument(
    services: ServicesOnThread, field: str
) -> None:
    retention = resources_pb2.Retention(
        tenant="acme",
        conversation_id="conv-newline",
        engine_id="engine-newline",
        engine_request_id="req-1",
        block_ids=[1],
        num_tokens=16,
        block_digests=[b"\x00" * 16],
        turn=1,
    )
    setattr(retention, field, getattr(retention, field) + "\n")
    with grpc.insecure_channel(services.registry.address) as channel:
        stub = registry_grpc.RegistryServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.PublishRetention(registry_pb2.PublishRetentionRequest(retention=retention), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (caught.value.details() or "")


# A field 1 of wire type 7 (no such type): no protobuf message decodes it.
UNDECODABLE = b"\x0f\x01\x02"


@pytest.mark.parametrize(
    "method",
    [
        "/kvferry.v1.RouterService/Generate",
        "/kvferry.v1.RegistryService/PublishRetention",
        "/kvferry.v1.RegistryService/ListEngines",
    ],
)
def test_undecodable_request_bytes_are_invalid_argument(services: ServicesOnThread, method: str) -> None:
    address = services.router.grpc_address if "Router" in method else services.registry.address
    with grpc.insecure_channel(address) as channel:
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        call = channel.unary_stream(method) if method.endswith("Generate") else channel.unary_unary(method)
        with pytest.raises(grpc.RpcError) as caught:
            reply = call(UNDECODABLE, metadata=metadata, timeout=10)
            list(reply) if method.endswith("Generate") else None
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert "not a valid message" in (caught.value.details() or "")
