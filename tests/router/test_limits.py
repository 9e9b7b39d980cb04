"""The router's limits: a body over the limit is refused (413) while it streams in, and one tenant's burst
is capped (429 / RESOURCE_EXHAUSTED with Retry-After) while another tenant's turns are served. Real
registry (real etcd), the router's real gRPC and HTTP servers, FAST STAND-IN engines."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest
from kvferry.router.limits import TenantLimits, TenantLimitSettings
from kvferry.router.server import RunningRouter
from kvferry.router.tenants import ApiKeys, Tenant, TenantConfigError, key_digest, parse_tenants
from kvferry.runtime.errors import ResourceExhausted
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.router import RouterFactory, StandInFactory, wait_for_engines
from tests.router.test_router_standin import chat_request, generate

pytestmark = pytest.mark.timeout(120)

ACME, GLOBEX = "key-acme", "key-globex"
MIB = 1024 * 1024
CAP = 4
ACME_TENANT, GLOBEX_TENANT = Tenant("acme"), Tenant("globex")


def test_a_tenant_past_its_cap_is_refused_and_others_are_not() -> None:
    limits = TenantLimits(TenantLimitSettings(max_concurrent_turns=2, retry_after_seconds=3))
    first = limits.admit(ACME_TENANT)
    assert not limits.refuses(ACME_TENANT)
    second = limits.admit(ACME_TENANT)
    assert limits.refuses(ACME_TENANT) and not limits.refuses(GLOBEX_TENANT)
    with pytest.raises(ResourceExhausted, match="2 turns in flight") as refused:
        limits.admit(ACME_TENANT)
    assert refused.value.retry_after_seconds == 3
    other = limits.admit(GLOBEX_TENANT)
    first.release()
    first.release()  # idempotent: a slot is given back once
    assert limits.in_flight("acme") == 1
    third = limits.admit(ACME_TENANT)
    for slot in (second, third, other):
        slot.release()
    assert limits.in_flight("acme") == limits.in_flight("globex") == 0


def test_no_cap_admits_everything() -> None:
    limits = TenantLimits(TenantLimitSettings())
    slots = [limits.admit(ACME_TENANT) for _ in range(1000)]
    assert limits.in_flight("acme") == 0
    for slot in slots:
        slot.release()
    with pytest.raises(ValueError, match="negative"):
        TenantLimitSettings(max_concurrent_turns=-1)
    for bad in ({"tokens_per_second": -1.0}, {"tokens_per_second": float("nan")}, {"token_burst_seconds": 0}):
        with pytest.raises(ValueError):
            TenantLimitSettings(**bad)  # type: ignore[arg-type]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# Each step: (seconds since the start, tokens charged by an admitted turn, or None to only try admitting;
# the expected outcome: "admit" or the Retry-After of the refusal). 10 tokens/s, a bucket of 2 s (20).
TOKEN_BUCKET_STEPS: list[tuple[float, int | None, str | int]] = [
    (0.0, 15, "admit"),  # 20 -> 5
    (0.0, 30, "admit"),  # not empty: admitted, and 5 - 30 = -25 (a turn's size is known only after)
    (0.0, None, 3),  # empty: 25 tokens of debt at 10/s -> retry after 2.5 s, rounded up
    (2.0, None, 1),  # -5: the refill pays the rest in 0.5 s; Retry-After is at least 1 s
    (2.5, None, 1),  # exactly empty is empty
    (3.0, 1, "admit"),  # 5 -> admitted, takes 1 -> 4
    (60.0, 20, "admit"),  # refilled to the bucket's 20, never more: 20 -> 0
    (60.0, None, 1),
]


def test_the_token_bucket_admits_while_not_empty_and_says_when_to_retry() -> None:
    clock = FakeClock()
    limits = TenantLimits(TenantLimitSettings(tokens_per_second=10, token_burst_seconds=2), clock=clock)
    for at, tokens, expected in TOKEN_BUCKET_STEPS:
        clock.now = at
        step = (at, tokens, expected)
        assert limits.refuses(ACME_TENANT) == (expected != "admit"), step
        if expected == "admit":
            slot = limits.admit(ACME_TENANT)
            slot.charge(tokens or 0)
            slot.release()
        else:
            with pytest.raises(ResourceExhausted, match="10 tokens per second") as refused:
                limits.admit(ACME_TENANT)
            assert refused.value.retry_after_seconds == expected, step
        # Another tenant has a bucket of its own.
        limits.admit(GLOBEX_TENANT).release()
    assert limits.tokens_left(ACME_TENANT) == 0
    assert limits.tokens_left(Tenant("acme", tokens_per_second=0)) is None


@pytest.mark.parametrize(
    ("default", "own", "admitted"),
    [
        (0.0, None, 100),  # no cap anywhere
        (5.0, None, 2),  # the default: a 10-token bucket, each turn 5 tokens, refused once empty
        (5.0, 0.0, 100),  # the tenant's own 0: no cap for it
        (0.0, 10.0, 4),  # the tenant's own rate without a default: 20 tokens
        (1000.0, 2.5, 1),  # the tenant's own rate wins over the default: 5 tokens
    ],
)
def test_a_tenants_own_rate_overrides_the_default(default: float, own: float | None, admitted: int) -> None:
    clock = FakeClock()
    limits = TenantLimits(TenantLimitSettings(tokens_per_second=default, token_burst_seconds=2), clock=clock)
    tenant = Tenant("acme", tokens_per_second=own)
    count = 0
    for _ in range(100):
        try:
            slot = limits.admit(tenant)
        except ResourceExhausted:
            break
        slot.charge(5)
        slot.release()
        count += 1
    assert count == admitted


@pytest.mark.parametrize(
    ("value", "accepted"),
    [(2000, 2000.0), (0.5, 0.5), (0, 0.0), (-1, None), ("fast", None), (True, None), (float("inf"), None)],
)
def test_the_tenants_file_names_a_rate_per_tenant(value: object, accepted: float | None) -> None:
    document = {"tenants": [{"name": "acme", "api_keys": ["k"], "tokens_per_second": value}]}
    if accepted is None:
        with pytest.raises(TenantConfigError, match="tokens_per_second"):
            parse_tenants(document, "tenants.json")
        return
    assert parse_tenants(document, "tenants.json").authenticate("Bearer k").tokens_per_second == accepted


async def _chunked_upload(router: RunningRouter, total: int, chunk: int) -> tuple[bytes, int]:
    """POSTs a chunked body of ``total`` bytes over a raw socket, stopping as soon as the router answers:
    (the response's head, the body bytes sent until then)."""
    reader, writer = await asyncio.open_connection(router.http_host, router.http_port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + ACME.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
    piece = f"{chunk:x}\r\n".encode() + b"x" * chunk + b"\r\n"
    sent = 0
    try:
        while sent < total and not answer.done():
            writer.write(piece)
            drained = asyncio.ensure_future(writer.drain())
            await asyncio.wait({drained, answer}, return_when=asyncio.FIRST_COMPLETED)
            if not drained.done():
                drained.cancel()
                break
            if drained.exception() is not None:
                break  # the router closed the connection: its answer is what matters
            sent += chunk
        head = await asyncio.wait_for(answer, 10)
    finally:
        writer.close()
    return head, sent


async def test_a_chunked_body_over_the_limit_is_refused_while_it_streams_in(
    router_factory: RouterFactory,
) -> None:
    limit = 1 * MIB
    router = await router_factory(max_body_bytes=limit)
    head, sent = await _chunked_upload(router, total=100 * MIB, chunk=64 * 1024)
    assert head.startswith(b"HTTP/1.1 413"), head
    # The router stopped reading past the limit: what was sent beyond it sits in socket buffers (a few
    # MiB on loopback), never the 100 MiB.
    assert sent < limit + 16 * MIB, sent
    async with httpx.AsyncClient(base_url=router.http_url) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            declared = await http.post(
                path, content=b"x" * (limit + 1), headers={"Authorization": f"Bearer {ACME}"}
            )
            assert declared.status_code == 413, path
            assert f"at most {limit}" in declared.json()["error"]["message"]


@pytest.fixture
async def capped(
    router_factory: RouterFactory, standin_factory: StandInFactory
) -> AsyncIterator[tuple[RunningRouter, str]]:
    model = f"standin-{uuid.uuid4().hex[:6]}"
    # Long engine leases: the stand-ins share this process's event loop with the router under the burst.
    prefill = await standin_factory("prefill", model=model, engine_ttl_seconds=60)
    # Each turn takes ~0.3 s of decoding: a burst overlaps.
    decode = await standin_factory(
        "decode", model=model, engine_ttl_seconds=60, decode_token_delay_seconds=0.04
    )
    router = await router_factory(max_turns_per_tenant=CAP)
    await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
    yield router, model


# The burst comes from a process of its own, as a real client's would: 500 clients in the test's event loop
# would starve the registry and stand-ins sharing it, not the router.
BURST_CLIENT = """
import asyncio, json, sys
import httpx

async def main(url, key, model, count):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        async def one():
            answer = await http.post(
                "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            message = answer.json().get("error", {}).get("message", "") if answer.status_code != 200 else ""
            return [answer.status_code, answer.headers.get("retry-after"), message]
        print(json.dumps(await asyncio.gather(*(one() for _ in range(count)))))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


async def test_a_tenants_burst_is_capped_while_another_tenant_is_served(
    capped: tuple[RunningRouter, str],
) -> None:
    router, model = capped
    highest = 0
    sampling = True

    async def watch() -> None:
        nonlocal highest
        while sampling:
            highest = max(highest, router.tenant_limits.in_flight("acme"))
            await asyncio.sleep(0.005)

    async def burst() -> list[tuple[int, str | None, str]]:
        client = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            BURST_CLIENT,
            router.http_url,
            ACME,
            model,
            "500",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await client.communicate()
        assert client.returncode == 0
        return [tuple(answer) for answer in json.loads(out)]  # type: ignore[misc]

    async def globex_turns() -> list[int]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        codes: list[int] = []
        async with httpx.AsyncClient(base_url=router.http_url, timeout=60) as http:
            while not bursting.done() or not codes:
                answer = await http.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {GLOBEX}"}
                )
                codes.append(answer.status_code)
        return codes

    watcher = asyncio.ensure_future(watch())
    bursting = asyncio.ensure_future(burst())
    globex_codes = await globex_turns()
    answers = await bursting
    sampling = False
    await watcher
    # The other tenant's turns all succeeded, during the whole burst.
    assert globex_codes and set(globex_codes) == {200}, globex_codes
    codes = [code for code, _, _ in answers]
    assert len(codes) == 500 and set(codes) == {200, 429}, set(codes)
    assert codes.count(200) >= CAP
    assert highest <= CAP
    for code, retry_after, message in answers:
        if code == 429:
            assert retry_after == "1" and "turns in flight" in message
    assert router.tenant_limits.in_flight("acme") == 0

    # gRPC: the same cap, RESOURCE_EXHAUSTED with a retry-after trailer.
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        stub = router_grpc.RouterServiceStub(channel)
        turns = [
            generate(stub, chat_request(f"c-{i}", model, [("user", "hi")]), ACME) for i in range(CAP + 4)
        ]
        outcomes = await asyncio.gather(*turns, return_exceptions=True)
    errors = [outcome for outcome in outcomes if isinstance(outcome, grpc.aio.AioRpcError)]
    assert errors and all(error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for error in errors)
    assert ("retry-after", "1") in tuple(errors[0].trailing_metadata() or ())
    assert len(outcomes) - len(errors) >= CAP


# acme may spend 50 tokens per second (a 10 s bucket: 500 tokens); globex has no token cap.
TOKEN_RATE = 50.0


@pytest.fixture
async def rate_capped(
    router_factory: RouterFactory, standin_factory: StandInFactory
) -> AsyncIterator[tuple[RunningRouter, str]]:
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model, engine_ttl_seconds=60)
    decode = await standin_factory("decode", model=model, engine_ttl_seconds=60)
    keys = ApiKeys(
        {
            key_digest(ACME): Tenant("acme", tokens_per_second=TOKEN_RATE),
            key_digest(GLOBEX): Tenant("globex", tokens_per_second=0.0),
        }
    )
    # The router's default would cap globex too: its own 0 overrides it.
    router = await router_factory(tokens_per_second_per_tenant=1.0, api_keys=keys)
    await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
    yield router, model


async def test_a_tenant_past_its_tokens_per_second_is_refused_before_any_engine(
    rate_capped: tuple[RunningRouter, str],
) -> None:
    router, model = rate_capped
    # A long prompt: each turn takes hundreds of tokens, so the bucket (500) empties within a few turns.
    body = {"model": model, "messages": [{"role": "user", "content": "tokens " * 300}], "max_tokens": 8}
    acme, globex = {"Authorization": f"Bearer {ACME}"}, {"Authorization": f"Bearer {GLOBEX}"}
    async with httpx.AsyncClient(base_url=router.http_url, timeout=60) as http:
        codes: list[int] = []
        refused: httpx.Response | None = None
        for _ in range(20):
            answer = await http.post("/v1/chat/completions", json=body, headers=acme)
            codes.append(answer.status_code)
            if answer.status_code == 429:
                refused = answer
                break
        assert refused is not None and set(codes[:-1]) == {200}, codes
        assert int(refused.headers["retry-after"]) >= 1
        assert "tokens per second" in refused.json()["error"]["message"]
        tokens_left = router.tenant_limits.tokens_left(Tenant("acme", tokens_per_second=TOKEN_RATE))
        assert tokens_left is not None and tokens_left <= 0
        # The other tenant is served meanwhile: its bucket is its own (here: none).
        for _ in range(len(codes) + 2):
            assert (await http.post("/v1/chat/completions", json=body, headers=globex)).status_code == 200

    # gRPC: the same bucket, RESOURCE_EXHAUSTED with a retry-after trailer.
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        stub = router_grpc.RouterServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(stub, chat_request("c-rate", model, [("user", "hi")]), ACME)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tokens per second" in (error.value.details() or "")
        trailers = dict(error.value.trailing_metadata() or ())
        assert int(trailers["retry-after"]) >= 1
        await generate(stub, chat_request("c-rate-globex", model, [("user", "hi")]), GLOBEX)
