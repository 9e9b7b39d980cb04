"""The registry's retention store as a hypothesis state machine, through the real registry (gRPC) on
the real etcd, with the registry's clock under the test's hand: publishes (new, retried, older turns,
ended requests), host-tier relocations, lookups, renewals, releases, ends by the engine, deregistrations and
time passing, against a model of what must be live.

What it checks after every call: a lookup returns exactly the model's live record or NOT_FOUND; a
record that ended (released, superseded, ended by its engine, engine gone) is never served or renewed
again; a request its engine ended is never published again; a relocation replaces only the live record it
names (same engine and turn) and never revives an ended one; the registry's clock moving ends nothing
(expiry is etcd's lease alone, and the real leases outlive an example).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import Registry, create_registry
from kvferry.runtime.clock import SystemClock
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.testing.loop_thread import LoopThread
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2

from tests.fixtures.registry import TEST_TTLS
from tests.registry.builders import engine as engine_proto
from tests.registry.builders import retention as retention_proto

RETENTION_TTL = TEST_TTLS.default_retention_ttl_seconds
ENGINES = ("e0", "e1")
CONVERSATIONS = ("c0", "c1")


class SteppedClock(SystemClock):
    """The registry's clock: real time, its wall clock plus what the test added."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset


@dataclass
class Served:
    engine: str
    request: str
    turn: int


@dataclass
class RegistryUnderTest:
    loop: LoopThread
    registry: Registry
    clock: SteppedClock
    stub: registry_grpc.RegistryServiceStub


@pytest.fixture(scope="module")
def registry_under_test(etcd: EtcdProcess) -> Iterator[RegistryUnderTest]:
    clock = SteppedClock()
    with LoopThread() as loop:
        registry = loop.run(
            create_registry(
                RegistryConfig(
                    listen_address="127.0.0.1:0",
                    etcd_endpoints=(etcd.endpoint,),
                    key_prefix=f"/kvferry-machine-{uuid.uuid4().hex[:8]}/",
                    ttl=TEST_TTLS,
                    history_seconds=0,
                ),
                clock=clock,
            )
        )
        with grpc.insecure_channel(registry.address) as channel:
            yield RegistryUnderTest(loop, registry, clock, registry_grpc.RegistryServiceStub(channel))
        loop.run(registry.stop(grace_seconds=0.2))


def _code(call: object) -> grpc.StatusCode:
    try:
        assert callable(call)
        call()
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


class RetentionStoreMachine(RuleBasedStateMachine):
    under_test: RegistryUnderTest

    def __init__(self) -> None:
        super().__init__()
        # A tenant and engine ids of its own per example: examples share one registry.
        self.tenant = f"t-{uuid.uuid4().hex[:10]}"
        self.engine_ids = {name: f"{name}-{self.tenant}" for name in ENGINES}
        self.registered: set[str] = set()
        self.live: dict[str, Served] = {}
        self.ended_requests: set[tuple[str, str]] = set()
        self.next_request = 0

    @property
    def stub(self) -> registry_grpc.RegistryServiceStub:
        return self.under_test.stub

    def _live(self, conversation: str) -> Served | None:
        """The model's live record while its engine is registered (the registry's clock plays no part)."""
        served = self.live.get(conversation)
        if served is not None and served.engine not in self.registered:
            del self.live[conversation]
            return None
        return served

    # -- engines ---------------------------------------------------------------------------------------

    @rule(name=st.sampled_from(ENGINES))
    def register(self, name: str) -> None:
        engine_id = self.engine_ids[name]
        self.stub.RegisterEngine(
            registry_pb2.RegisterEngineRequest(engine=engine_proto(engine_id), ttl_seconds=120), timeout=10
        )
        if engine_id not in self.registered:
            self.registered.add(engine_id)
        else:
            # A new incarnation: what the old one published is void.
            for conversation, served in list(self.live.items()):
                if served.engine == engine_id:
                    del self.live[conversation]

    @rule(name=st.sampled_from(ENGINES))
    def deregister(self, name: str) -> None:
        engine_id = self.engine_ids[name]
        code = _code(
            lambda: self.stub.DeregisterEngine(
                registry_pb2.DeregisterEngineRequest(engine_id=engine_id), timeout=10
            )
        )
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND)
        self.registered.discard(engine_id)
        for conversation, served in list(self.live.items()):
            if served.engine == engine_id:
                del self.live[conversation]

    # -- retentions ------------------------------------------------------------------------------------

    @rule(
        conversation=st.sampled_from(CONVERSATIONS),
        name=st.sampled_from(ENGINES),
        turn=st.integers(1, 4),
        retry=st.booleans(),
    )
    def publish(self, conversation: str, name: str, turn: int, retry: bool) -> None:
        engine_id = self.engine_ids[name]
        current = self._live(conversation)
        if retry and current is not None:
            engine_id, request, turn = current.engine, current.request, current.turn
        else:
            request = f"req-{self.next_request}"
            self.next_request += 1
        item = retention_proto(self.tenant, conversation, engine_id, turn=turn)
        item.engine_request_id = request
        code = _code(
            lambda: self.stub.PublishRetention(
                registry_pb2.PublishRetentionRequest(retention=item), timeout=10
            )
        )
        if engine_id not in self.registered or (engine_id, request) in self.ended_requests:
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, "unregistered or ended")
            return
        if current is not None and current.turn >= turn and current.request != request:
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, "not newer")
            return
        assert code == grpc.StatusCode.OK, code
        if current is None or current.request != request:
            self.live[conversation] = Served(engine_id, request, turn)

    @rule(conversation=st.sampled_from(CONVERSATIONS), data=st.data())
    def relocate(self, conversation: str, data: st.DataObject) -> None:
        """A host-tier move: the same turn under a new request id, naming the record it replaces (the live
        one, or another: an ended one, a made-up one), from the holder or another engine."""
        current = self._live(conversation)
        request = f"req-{self.next_request}"
        self.next_request += 1
        if current is not None and data.draw(st.booleans()):
            engine_id, replaced, turn = current.engine, current.request, current.turn
        else:
            engine_id = self.engine_ids[data.draw(st.sampled_from(ENGINES))]
            # An earlier request of this example (ended, superseded or live), never the new one itself.
            replaced = (
                f"req-{data.draw(st.integers(0, self.next_request - 2))}"
                if self.next_request > 1
                else "req-x"
            )
            turn = current.turn if current is not None else data.draw(st.integers(1, 4))
        item = retention_proto(self.tenant, conversation, engine_id, turn=turn)
        item.engine_request_id = request
        item.relocates_engine_request_id = replaced
        item.tier = resources_pb2.MEMORY_TIER_HOST
        item.block_ids[:] = [5000 + b for b in item.block_ids]
        code = _code(
            lambda: self.stub.PublishRetention(
                registry_pb2.PublishRetentionRequest(retention=item), timeout=10
            )
        )
        moves_live = current is not None and (current.engine, current.request, current.turn) == (
            engine_id,
            replaced,
            turn,
        )
        if not moves_live:
            # Never over another record, never reviving an ended one.
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, "relocation of what is not live")
            return
        assert code == grpc.StatusCode.OK, code
        self.live[conversation] = Served(engine_id, request, turn)

    @rule(conversation=st.sampled_from(CONVERSATIONS))
    def lookup(self, conversation: str) -> None:
        expected = self._live(conversation)
        try:
            answer = self.stub.GetRetention(
                registry_pb2.GetRetentionRequest(tenant=self.tenant, conversation_id=conversation), timeout=10
            )
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND, error
            assert expected is None, f"{conversation}: NOT_FOUND, but {expected} is live"
            return
        got = answer.retention
        assert expected is not None, f"{conversation}: served {got.engine_request_id}, but nothing is live"
        assert (got.engine_id, got.engine_request_id, got.turn) == (
            expected.engine,
            expected.request,
            expected.turn,
        )

    @rule(conversation=st.sampled_from(CONVERSATIONS))
    def renew(self, conversation: str) -> None:
        expected = self._live(conversation)
        code = _code(
            lambda: self.stub.RenewRetention(
                registry_pb2.RenewRetentionRequest(tenant=self.tenant, conversation_id=conversation),
                timeout=10,
            )
        )
        if expected is None:
            assert code == grpc.StatusCode.NOT_FOUND, code
            return
        assert code == grpc.StatusCode.OK, code

    @rule(conversation=st.sampled_from(CONVERSATIONS))
    def release(self, conversation: str) -> None:
        expected = self._live(conversation)
        code = _code(
            lambda: self.stub.ReleaseRetention(
                registry_pb2.ReleaseRetentionRequest(tenant=self.tenant, conversation_id=conversation),
                timeout=10,
            )
        )
        if expected is None:
            assert code == grpc.StatusCode.NOT_FOUND, code
            return
        assert code == grpc.StatusCode.OK, code
        del self.live[conversation]

    @rule(conversation=st.sampled_from(CONVERSATIONS), data=st.data())
    def engine_ends(self, conversation: str, data: st.DataObject) -> None:
        """EndEngineRetention of the live request (or of another: the live one is left alone)."""
        expected = self._live(conversation)
        if expected is not None and data.draw(st.booleans()):
            engine_id, request = expected.engine, expected.request
        else:
            engine_id = self.engine_ids[data.draw(st.sampled_from(ENGINES))]
            request = f"req-{data.draw(st.integers(0, max(0, self.next_request)))}"
        code = _code(
            lambda: self.stub.EndEngineRetention(
                registry_pb2.EndEngineRetentionRequest(
                    tenant=self.tenant,
                    conversation_id=conversation,
                    engine_id=engine_id,
                    engine_request_id=request,
                ),
                timeout=10,
            )
        )
        if code == grpc.StatusCode.OK:
            self.ended_requests.add((engine_id, request))
            if expected is not None and (expected.engine, expected.request) == (engine_id, request):
                del self.live[conversation]
        else:
            # Refused (e.g. an engine not registered): the live record must be as it was.
            assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION), code

    @rule(seconds=st.sampled_from([RETENTION_TTL / 2, RETENTION_TTL + 1]))
    def time_passes(self, seconds: float) -> None:
        """The registry's clock jumps, even past a whole TTL: no record may end by it."""
        self.under_test.clock.offset += seconds


@pytest.mark.timeout(600)
def test_retention_store_state_machine(registry_under_test: RegistryUnderTest) -> None:
    RetentionStoreMachine.under_test = registry_under_test
    machine = RetentionStoreMachine.TestCase
    machine.settings = settings(
        max_examples=150,
        stateful_step_count=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine().runTest()
