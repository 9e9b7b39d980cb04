"""The picker under TLS, as deployed: it serves the gateway's ext_proc over TLS (no client certificate asked)
and reads a mutual-TLS registry in the role `router`, against the real registry and real certificates."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as Mode
from envoy_data_plane.envoy.service.ext_proc.v3 import ExternalProcessorSyncStub, ProcessingResponse
from kvferry.picker.server import PickerConfig, start_picker
from kvferry.v1 import registry_service_pb2 as registry

from tests.fixtures.registry import unique
from tests.fixtures.router import router_api_keys
from tests.picker.test_ext_proc import Answer, envoy_messages, request_headers, until
from tests.registry.builders import engine, retention
from tests.registry.test_access import ROUTER_URI, Tls, tls  # noqa: F401 (the TLS registry fixture)


async def test_the_picker_serves_tls_and_reads_a_mutual_tls_registry(tls: Tls) -> None:  # noqa: F811
    engine_id = unique("engine")
    holder = tls.as_engine(engine_id)
    registered = await holder.RegisterEngine(
        registry.RegisterEngineRequest(engine=engine(engine_id)), timeout=5
    )
    conversation = unique("conv")
    await holder.PublishRetention(
        registry.PublishRetentionRequest(
            retention=retention("acme", conversation, engine_id), incarnation=registered.incarnation
        ),
        timeout=5,
    )
    picker = await start_picker(
        PickerConfig(
            registry_address=tls.running.address,
            listen="127.0.0.1:0",
            tls=tls.pki.issue("picker", uris=[ROUTER_URI]),
        ),
        api_keys=router_api_keys(),
    )
    try:
        await until(lambda: picker.engines.get(engine_id) is not None)
        body = json.dumps({"model": "qwen3-tiny", "conversation_id": conversation}).encode()
        messages = envoy_messages(Mode.BUFFERED, request_headers(key="key-acme"), body)

        def call(secure: bool) -> list[ProcessingResponse]:
            credentials = grpc.ssl_channel_credentials(root_certificates=tls.pki.ca.read_bytes())
            channel = (
                grpc.secure_channel(picker.address, credentials)
                if secure
                else grpc.insecure_channel(picker.address)
            )
            with channel:
                return list(ExternalProcessorSyncStub(channel).process(iter(messages)))

        answer = Answer(await asyncio.to_thread(call, True))
        assert answer.immediate is None, answer.immediate
        assert answer.destination == "127.0.0.1:8100"
        assert answer.mutation_headers()["x-kvferry-pick-reason"] == "retained"
        with pytest.raises(grpc.RpcError):  # a plaintext client is not served
            await asyncio.to_thread(call, False)
    finally:
        await picker.stop(grace_seconds=0.2)
