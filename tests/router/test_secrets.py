"""No secret in any repr, log line or error message: every configured API key (and a client's private
key) is grepped for in the reprs of the configurations that hold them, in the errors of bad
configurations, and in every log record and answer of a run (real registry and etcd, the router's gRPC
and HTTP servers, stand-in engines) with good, wrong and malformed credentials."""

from __future__ import annotations

import logging
import uuid

import grpc
import httpx
import pytest
from kvferry.router.server import RouterConfig, start_router
from kvferry.router.tenants import TenantConfigError, parse_key_pairs
from kvferry.sdk import ClientConfig, TlsConfig
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.registry import RegistryHandle
from tests.fixtures.router import StandInFactory, wait_for_engines
from tests.router.test_router_standin import chat_request, generate

pytestmark = pytest.mark.timeout(60)

ACME_KEY = "sk-acme-" + uuid.uuid4().hex
GLOBEX_KEY = "sk-globex-" + uuid.uuid4().hex
PRIVATE_KEY = (
    b"-----BEGIN PRIVATE KEY-----\nsecret-" + uuid.uuid4().hex.encode() + b"\n-----END PRIVATE KEY-----\n"
)
SECRETS = (ACME_KEY, GLOBEX_KEY, PRIVATE_KEY.decode())


def _leaks(text: str) -> list[str]:
    """The secrets (or an 8-character piece of one's random part) found in ``text``."""
    found = []
    for secret in SECRETS:
        random_part = secret.split("-")[-1] if secret.startswith("sk-") else secret.split("secret-")[1][:32]
        if secret in text or random_part[:8] in text:
            found.append(secret[:6] + "...")
    return found


def test_configurations_do_not_show_their_secrets() -> None:
    client = ClientConfig(
        "127.0.0.1:1",
        api_key=ACME_KEY,
        tls=TlsConfig(certificate_chain=b"cert", private_key=PRIVATE_KEY),
    )
    assert not _leaks(repr(client)) and not _leaks(str(client))
    router = RouterConfig(registry_address="127.0.0.1:1", api_keys=f"{ACME_KEY}=acme,{GLOBEX_KEY}=globex")
    assert not _leaks(repr(router))


@pytest.mark.parametrize(
    "spec", [ACME_KEY, f"{ACME_KEY}=", f"{ACME_KEY}=bad/tenant", f"ok=acme,{GLOBEX_KEY}"]
)
def test_a_malformed_key_list_names_the_entry_not_the_key(spec: str) -> None:
    with pytest.raises(TenantConfigError) as refused:
        parse_key_pairs(spec)
    assert "API key entry" in str(refused.value)
    assert not _leaks(str(refused.value)), str(refused.value)


async def test_a_run_logs_no_key(
    registry: RegistryHandle, standin_factory: StandInFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model)
    decode = await standin_factory("decode", model=model)
    router = await start_router(
        RouterConfig(
            registry_address=registry.address,
            api_keys=f"{ACME_KEY}=acme,{GLOBEX_KEY}=globex",
            startup_sync_seconds=5.0,
        )
    )
    answers: list[str] = []
    try:
        await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with httpx.AsyncClient(base_url=router.http_url, timeout=20) as http:
            for authorization in (
                f"Bearer {ACME_KEY}",
                f"Bearer {GLOBEX_KEY}",
                f"Bearer {ACME_KEY}x",  # wrong key, one character off
                f"Basic {ACME_KEY}",  # malformed scheme
                ACME_KEY,  # no scheme at all
            ):
                answer = await http.post(
                    "/v1/chat/completions", json=body, headers={"Authorization": authorization}
                )
                answers.append(answer.text)
        async with grpc.aio.insecure_channel(router.grpc_address) as channel:
            stub = router_grpc.RouterServiceStub(channel)
            await generate(stub, chat_request(f"c-{uuid.uuid4().hex[:6]}", model, [("user", "hi")]), ACME_KEY)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await generate(stub, chat_request("c-x", model, [("user", "hi")]), GLOBEX_KEY + "x")
            answers.append(refused.value.details() or "")
    finally:
        await router.stop(grace_seconds=0.5)
    assert sum("unknown API key" in text for text in answers) == 2  # HTTP and gRPC: refused, not echoed
    for text in answers:
        assert not _leaks(text), text
    assert caplog.records
    for record in caplog.records:
        logged = f"{record.getMessage()} {record.__dict__}"
        assert not _leaks(logged), logged
