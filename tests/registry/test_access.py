"""The registry under mutual TLS, with real certificates (made here) and real etcd: each identity may do
what its role allows and nothing else (kvferry.registry.access), and a caller without a certificate from
the deployment's CA is never served."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import shutil
import ssl
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import Registry, create_registry
from kvferry.router.registry_client import GrpcRegistry as RouterRegistry
from kvferry.router.server import RouterConfig, start_router
from kvferry.runtime.errors import ErrorKind
from kvferry.runtime.tls import TlsFiles, open_channel
from kvferry.sidecar.registry_link import GrpcRegistry as SidecarRegistry
from kvferry.sidecar.registry_link import RegistryError
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2 as resources
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.certificates import TestPki, certificate_der, engine_uri, install, served_certificate
from tests.fixtures.registry import TEST_TTLS, unique
from tests.fixtures.router import router_api_keys
from tests.registry.builders import engine, retention

ROUTER_URI = "spiffe://cluster.local/ns/kvferry-test/kvferry/router"


class Tls:
    """The TLS registry and a way to call it as any identity."""

    def __init__(self, running: Registry, pki: TestPki) -> None:
        self.running = running
        self.pki = pki
        self._channels: list[grpc.aio.Channel] = []

    def stub(self, files: TlsFiles | None) -> registry_grpc.RegistryServiceStub:
        channel = open_channel(self.running.address, files)
        self._channels.append(channel)
        return registry_grpc.RegistryServiceStub(channel)

    def as_engine(self, engine_id: str) -> registry_grpc.RegistryServiceStub:
        return self.stub(self.pki.issue(f"engine-{engine_id}", uris=[engine_uri(engine_id)]))

    def as_router(self) -> registry_grpc.RegistryServiceStub:
        return self.stub(self.pki.issue(f"router-{uuid.uuid4().hex[:6]}", uris=[ROUTER_URI]))

    def as_admin(self) -> registry_grpc.RegistryServiceStub:
        return self.stub(self.pki.issue(f"admin-{uuid.uuid4().hex[:6]}", common_name="admin"))

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


@pytest_asyncio.fixture(loop_scope="session")
async def tls(etcd: EtcdProcess, tmp_path: Path) -> AsyncIterator[Tls]:
    pki = TestPki(tmp_path / "pki")
    config = RegistryConfig(
        listen_address="127.0.0.1:0",
        etcd_endpoints=(etcd.endpoint,),
        key_prefix=f"/kvferry-tls-{uuid.uuid4().hex[:8]}/",
        ttl=TEST_TTLS,
        history_seconds=0,
        tls=pki.issue("registry", common_name="registry"),
    )
    running = await create_registry(config)
    handle = Tls(running, pki)
    try:
        yield handle
    finally:
        await handle.close()
        await running.stop(grace_seconds=0.2)


async def _denied(call: Callable[[], object], *, code: grpc.StatusCode, says: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call()  # type: ignore[misc]
    assert refused.value.code() == code, refused.value.details()
    details = refused.value.details() or ""
    assert says in details, details
    return details


def _publish(item: resources.Retention, incarnation: int = 0) -> registry.PublishRetentionRequest:
    return registry.PublishRetentionRequest(retention=item, incarnation=incarnation)


async def _register(stub: registry_grpc.RegistryServiceStub, engine_id: str) -> int:
    response = await stub.RegisterEngine(registry.RegisterEngineRequest(engine=engine(engine_id)), timeout=5)
    return int(response.incarnation)


async def test_an_engine_registers_heartbeats_and_publishes_only_as_itself(tls: Tls) -> None:
    mine, other = unique("engine"), unique("engine")
    stub = tls.as_engine(mine)
    incarnation = await _register(stub, mine)
    await stub.HeartbeatEngine(
        registry.HeartbeatEngineRequest(engine_id=mine, incarnation=incarnation), timeout=5
    )
    tenant, conversation = unique("tenant"), unique("conv")
    published = await stub.PublishRetention(
        _publish(retention(tenant, conversation, mine), incarnation),
        timeout=5,
    )
    assert published.retention.engine_id == mine

    await _denied(
        lambda: stub.RegisterEngine(registry.RegisterEngineRequest(engine=engine(other)), timeout=5),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="only-engines-register-themselves",
    )
    await _register(tls.as_engine(other), other)
    await _denied(
        lambda: stub.HeartbeatEngine(registry.HeartbeatEngineRequest(engine_id=other), timeout=5),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="only-engines-heartbeat-themselves",
    )
    await _denied(
        lambda: stub.DeregisterEngine(registry.DeregisterEngineRequest(engine_id=other), timeout=5),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="engines-deregister-themselves-or-admin",
    )
    await _denied(
        lambda: stub.PublishRetention(
            _publish(retention(tenant, unique("conv"), other), 1),
            timeout=5,
        ),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="only-engines-publish-their-own-retentions",
    )
    # A heartbeat or publish that names no incarnation cannot be fenced: refused to engine identities.
    await _denied(
        lambda: stub.HeartbeatEngine(registry.HeartbeatEngineRequest(engine_id=mine), timeout=5),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="engines-name-their-incarnation",
    )


async def test_an_engine_cannot_act_for_a_tenant(tls: Tls) -> None:
    engine_id = unique("engine")
    stub = tls.as_engine(engine_id)
    incarnation = await _register(stub, engine_id)
    tenant, conversation = unique("tenant"), unique("conv")
    await stub.PublishRetention(
        _publish(retention(tenant, conversation, engine_id), incarnation),
        timeout=5,
    )
    for call in (
        lambda: stub.RenewRetention(
            registry.RenewRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        ),
        lambda: stub.RenewRetentions(
            registry.RenewRetentionsRequest(
                renewals=[registry.RenewRetentionRequest(tenant=tenant, conversation_id=conversation)]
            ),
            timeout=5,
        ),
        lambda: stub.ReleaseRetention(
            registry.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        ),
        lambda: stub.BeginTurn(
            registry.BeginTurnRequest(
                tenant=tenant, conversation_id=conversation, request_id="r1", holder="impostor"
            ),
            timeout=5,
        ),
        lambda: stub.EndTurn(
            registry.EndTurnRequest(tenant=tenant, conversation_id=conversation, request_id="r1"), timeout=5
        ),
    ):
        await _denied(call, code=grpc.StatusCode.PERMISSION_DENIED, says="only-routers-act-for-tenants")
    for call in (
        lambda: stub.ListEngines(registry.ListEnginesRequest(), timeout=5),
        lambda: anext(aiter(stub.WatchAllRetentions(registry.WatchAllRetentionsRequest(), timeout=5))),
    ):
        await _denied(
            call, code=grpc.StatusCode.PERMISSION_DENIED, says="routers-and-admins-list-and-watch-all"
        )
    # The retention is still there, untouched.
    found = await tls.as_router().GetRetention(
        registry.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    assert found.retention.engine_id == engine_id


async def test_an_engine_sees_only_the_retentions_it_holds(tls: Tls) -> None:
    holder, other = unique("engine"), unique("engine")
    holder_stub = tls.as_engine(holder)
    incarnation = await _register(holder_stub, holder)
    await _register(tls.as_engine(other), other)
    tenant, conversation = unique("tenant"), unique("conv")
    await holder_stub.PublishRetention(
        _publish(retention(tenant, conversation, holder), incarnation),
        timeout=5,
    )
    request = registry.GetRetentionRequest(tenant=tenant, conversation_id=conversation)
    assert (await holder_stub.GetRetention(request, timeout=5)).retention.engine_id == holder
    await _denied(
        lambda: tls.as_engine(other).GetRetention(request, timeout=5),
        code=grpc.StatusCode.NOT_FOUND,
        says=f"engine {other} holds no retention",
    )


async def test_a_publish_from_a_stale_incarnation_is_refused(tls: Tls) -> None:
    engine_id = unique("engine")
    stub = tls.as_engine(engine_id)
    stale = await _register(stub, engine_id)
    current = await _register(stub, engine_id)  # the engine registered again (a restart)
    assert current != stale
    tenant = unique("tenant")
    await _denied(
        lambda: stub.PublishRetention(
            _publish(retention(tenant, unique("conv"), engine_id), stale),
            timeout=5,
        ),
        code=grpc.StatusCode.FAILED_PRECONDITION,
        says="registered under incarnation",
    )
    await stub.PublishRetention(
        _publish(retention(tenant, unique("conv"), engine_id), current),
        timeout=5,
    )


async def test_the_router_acts_for_tenants_but_cannot_register_engines(tls: Tls) -> None:
    engine_id = unique("engine")
    router = tls.as_router()
    await _denied(
        lambda: router.RegisterEngine(registry.RegisterEngineRequest(engine=engine(engine_id)), timeout=5),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="only-engines-register-themselves",
    )
    await _denied(
        lambda: router.PublishRetention(
            _publish(retention(unique("tenant"), unique("conv"), engine_id)),
            timeout=5,
        ),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="only-engines-publish-their-own-retentions",
    )
    engine_stub = tls.as_engine(engine_id)
    incarnation = await _register(engine_stub, engine_id)
    tenant, conversation = unique("tenant"), unique("conv")
    await engine_stub.PublishRetention(
        _publish(retention(tenant, conversation, engine_id), incarnation),
        timeout=5,
    )
    # The router's own client, over its TLS channel: lookup, renewal, turn mark, release, listing.
    channel = open_channel(tls.running.address, tls.pki.issue("router-client", uris=[ROUTER_URI]))
    try:
        found = await RouterRegistry(channel, timeout_seconds=5).get_retention(tenant, conversation)
    finally:
        await channel.close()
    assert found is not None and found.engine_id == engine_id
    await router.RenewRetention(
        registry.RenewRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    begin = registry.BeginTurnRequest(
        tenant=tenant, conversation_id=conversation, request_id="r1", holder="router:1"
    )
    await router.BeginTurn(begin, timeout=5)
    end = registry.EndTurnRequest(tenant=tenant, conversation_id=conversation, request_id="r1")
    await router.EndTurn(end, timeout=5)
    listed = await router.ListEngines(registry.ListEnginesRequest(), timeout=5)
    assert engine_id in {item.engine_id for item in listed.engines}
    await router.ReleaseRetention(
        registry.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )


async def test_an_admin_lists_everything_but_does_not_act_for_tenants(tls: Tls) -> None:
    admin = tls.as_admin()
    await admin.ListEngines(registry.ListEnginesRequest(), timeout=5)
    await _denied(
        lambda: admin.RenewRetention(
            registry.RenewRetentionRequest(tenant=unique("tenant"), conversation_id=unique("conv")), timeout=5
        ),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="only-routers-act-for-tenants",
    )
    await _denied(
        lambda: admin.RegisterEngine(
            registry.RegisterEngineRequest(engine=engine(unique("engine"))), timeout=5
        ),
        code=grpc.StatusCode.PERMISSION_DENIED,
        says="only-engines-register-themselves",
    )


async def test_a_certificate_naming_no_role_is_unauthenticated(tls: Tls) -> None:
    stub = tls.stub(tls.pki.issue("nobody", common_name="nobody"))
    await _denied(
        lambda: stub.ListEngines(registry.ListEnginesRequest(), timeout=5),
        code=grpc.StatusCode.UNAUTHENTICATED,
        says="names no kvferry role",
    )


async def test_no_certificate_from_the_ca_is_never_served(tls: Tls, tmp_path: Path) -> None:
    """grpc's TLS server refuses the handshake itself when the client sends no certificate (Python's grpc
    can only require one or not ask for it): the call fails UNAVAILABLE and no handler runs."""
    outsider = TestPki(tmp_path / "other-ca", name="other-ca")
    without_certificate = grpc.aio.secure_channel(
        tls.running.address, grpc.ssl_channel_credentials(root_certificates=tls.pki.ca.read_bytes())
    )
    # A certificate of another CA naming a valid role, trusting the registry's CA.
    foreign = outsider.issue("foreign-router", uris=[ROUTER_URI], ca=tls.pki.ca)
    plaintext = grpc.aio.insecure_channel(tls.running.address)
    for channel in (without_certificate, open_channel(tls.running.address, foreign), plaintext):
        stub = registry_grpc.RegistryServiceStub(channel)
        try:
            await _denied(
                functools.partial(stub.ListEngines, registry.ListEnginesRequest(), timeout=5),
                code=grpc.StatusCode.UNAVAILABLE,
                says="",
            )
        finally:
            await channel.close()


async def test_the_sidecars_link_publishes_under_its_incarnation(tls: Tls) -> None:
    engine_id = unique("engine")
    link = SidecarRegistry(
        tls.running.address,
        timeout_seconds=5,
        tls=tls.pki.issue(f"link-{engine_id}", uris=[engine_uri(engine_id)]),
    )
    try:
        registered = await link.register_engine(engine(engine_id), 0)
        await link.heartbeat_engine(engine_id, None, registered.incarnation)
        tenant, conversation = unique("tenant"), unique("conv")
        await link.publish_retention(retention(tenant, conversation, engine_id), registered.incarnation)
        with pytest.raises(RegistryError) as refused:
            stale = registered.incarnation + 1
            await link.publish_retention(retention(tenant, unique("conv"), engine_id), stale)
        assert refused.value.kind is ErrorKind.FAILED_PRECONDITION
        found = await link.get_retention(tenant, conversation)
        assert found.retention.engine_id == engine_id
    finally:
        await link.close()


async def test_the_registry_speaks_mutual_tls_to_etcd(tmp_path: Path) -> None:
    """etcd with --client-cert-auth: the registry reaches it with --etcd-tls-* and serves; without a
    certificate etcd refuses it."""
    pki = TestPki(tmp_path / "pki")
    etcd = EtcdProcess(tmp_path / "etcd", tls=pki.issue("etcd", common_name="etcd"), die_with_parent=True)
    await asyncio.to_thread(etcd.start)
    base = RegistryConfig(
        listen_address="127.0.0.1:0",
        etcd_endpoints=(etcd.endpoint,),
        etcd_timeout_seconds=1.0,
        key_prefix=f"/kvferry-etcd-tls-{uuid.uuid4().hex[:8]}/",
        ttl=TEST_TTLS,
        history_seconds=0,
    )
    try:
        running = await create_registry(
            dataclasses.replace(
                base,
                etcd_tls=pki.issue("registry-etcd", common_name="registry"),
                # Only the refused plaintext registry below needs to give up fast; this one must serve on
                # a loaded machine.
                etcd_timeout_seconds=5.0,
            )
        )
        try:
            async with grpc.aio.insecure_channel(running.address) as channel:
                stub = registry_grpc.RegistryServiceStub(channel)
                engine_id = unique("engine")
                await _register(stub, engine_id)
                listed = await stub.ListEngines(registry.ListEnginesRequest(), timeout=5)
                assert engine_id in {item.engine_id for item in listed.engines}
        finally:
            await running.stop(grace_seconds=0.2)
        plaintext = await create_registry(base)
        try:
            async with grpc.aio.insecure_channel(plaintext.address) as channel:
                await _denied(
                    lambda: registry_grpc.RegistryServiceStub(channel).ListEngines(
                        registry.ListEnginesRequest(), timeout=5
                    ),
                    code=grpc.StatusCode.UNAVAILABLE,
                    says="etcd",
                )
        finally:
            await plaintext.stop(grace_seconds=0.2)
    finally:
        await asyncio.to_thread(etcd.stop)


async def test_the_router_serves_agents_over_tls_and_calls_the_registry_as_router(
    tls: Tls, tmp_path: Path
) -> None:
    """The router's certificate: HTTPS and gRPC over TLS for agents (no client certificate asked: API keys
    authenticate them), mutual TLS to the registry as `router` (it lists and watches the engines)."""
    engine_id = unique("engine")
    await _register(tls.as_engine(engine_id), engine_id)
    router_tls = tls.pki.issue("router-server", uris=[ROUTER_URI])
    router = await start_router(
        RouterConfig(registry_address=tls.running.address, tls=router_tls, startup_sync_seconds=5.0),
        api_keys=router_api_keys(),
    )
    try:
        assert router.http_url.startswith("https://")
        deadline = asyncio.get_running_loop().time() + 5
        while engine_id not in {item.engine_id for item in router.engines.all()}:
            assert asyncio.get_running_loop().time() < deadline, "the router never listed the engine"
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(tls.pki.ca))) as http:
            acme = {"Authorization": "Bearer key-acme"}
            models = await http.get(router.http_url + "/v1/models", headers=acme)
        assert models.status_code == 200
        agent = grpc.ssl_channel_credentials(root_certificates=tls.pki.ca.read_bytes())
        async with grpc.aio.secure_channel(router.grpc_address, agent) as channel:
            await _denied(
                lambda: anext(
                    aiter(
                        router_grpc.RouterServiceStub(channel).Generate(
                            router_pb2.GenerateRequest(conversation_id="c", model="nope"),
                            metadata=(("authorization", "Bearer key-acme"),),
                            timeout=5,
                        )
                    )
                ),
                # Answered by the router's servicer: the call got through TLS.
                code=grpc.StatusCode.INVALID_ARGUMENT,
                says="the prompt is missing",
            )
        async with grpc.aio.insecure_channel(router.grpc_address) as plaintext:
            await _denied(
                lambda: anext(
                    aiter(
                        router_grpc.RouterServiceStub(plaintext).Generate(
                            router_pb2.GenerateRequest(conversation_id="c", model="nope"), timeout=5
                        )
                    )
                ),
                code=grpc.StatusCode.UNAVAILABLE,
                says="",
            )
    finally:
        await router.stop(grace_seconds=0.2)


async def test_the_routers_https_port_takes_a_rotated_certificate_without_a_restart(
    tls: Tls, tmp_path: Path
) -> None:
    """uvicorn's TLS context follows the router's files as its gRPC port does: a new HTTPS connection gets
    the rotated certificate, one opened before keeps serving, and a key that does not match is not taken."""
    live = TlsFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    first = tls.pki.issue("router-first", uris=[ROUTER_URI])
    install(first, live)
    router = await start_router(
        RouterConfig(registry_address=tls.running.address, tls=live, startup_sync_seconds=5.0),
        api_keys=router_api_keys(),
    )
    trust = ssl.create_default_context(cafile=str(tls.pki.ca))
    acme = {"Authorization": "Bearer key-acme"}
    try:
        async with httpx.AsyncClient(verify=trust) as opened_before:
            assert (await opened_before.get(router.http_url + "/v1/models", headers=acme)).status_code == 200
            assert await served_certificate(router.http_port, tls.pki.ca) == certificate_der(first)

            second = tls.pki.issue("router-second", uris=[ROUTER_URI])
            install(second, live)
            await asyncio.sleep(1.1)  # the router looks at its files at most once a second
            assert await served_certificate(router.http_port, tls.pki.ca) == certificate_der(second)
            assert (await opened_before.get(router.http_url + "/v1/models", headers=acme)).status_code == 200
        async with httpx.AsyncClient(verify=trust) as opened_after:
            assert (await opened_after.get(router.http_url + "/v1/models", headers=acme)).status_code == 200

        shutil.copy(tls.pki.issue("router-third", uris=[ROUTER_URI]).key, live.key)
        await asyncio.sleep(1.1)
        assert await served_certificate(router.http_port, tls.pki.ca) == certificate_der(second)
    finally:
        await router.stop(grace_seconds=0.2)
