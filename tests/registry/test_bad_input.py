"""Every kind of bad request gets the right status, an actionable message, and changes nothing."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from kvferry.registry import validation
from kvferry.runtime.ids import MAX_ID_LENGTH
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources

from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import EventStream, engine, get, publish, register, retention, status_of

pytestmark = pytest.mark.timeout(60)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOO_LONG = "x" * (MAX_ID_LENGTH + 1)

RetentionEdit = Callable[[resources.Retention], None]


def _set(field: str, value: object) -> RetentionEdit:
    def edit(item: resources.Retention) -> None:
        setattr(item, field, value)

    return edit


def _clear_blocks(item: resources.Retention) -> None:
    del item.block_ids[:]


def _drop_digest(item: resources.Retention) -> None:
    del item.block_digests[-1]


def _extra_digest(item: resources.Retention) -> None:
    item.block_digests.append(b"\x00" * 16)


def _more_digests_than_blocks(item: resources.Retention) -> None:
    del item.block_ids[1:]


def _short_digest(item: resources.Retention) -> None:
    item.block_digests[0] = b"\x01\x02"


def _negative_block(item: resources.Retention) -> None:
    item.block_ids[0] = -1


def _a_generation_missing(item: resources.Retention) -> None:
    item.block_generations.extend([7] * (len(item.block_ids) - 1))


def _a_generation_too_large(item: resources.Retention) -> None:
    item.block_generations.extend([7] * len(item.block_ids))
    item.block_generations[-1] = 2**53


def _relocation(relocates: str, tier: resources.MemoryTier.ValueType) -> RetentionEdit:
    def edit(item: resources.Retention) -> None:
        item.relocates_engine_request_id = relocates or item.engine_request_id
        item.tier = tier

    return edit


PUBLISH_CASES: list[tuple[str, RetentionEdit, grpc.StatusCode, str]] = [
    ("empty tenant", _set("tenant", ""), INVALID, "tenant is required"),
    ("oversized tenant", _set("tenant", TOO_LONG), INVALID, "at most"),
    ("tenant with a slash", _set("tenant", "a/b"), INVALID, "characters outside"),
    ("empty conversation", _set("conversation_id", ""), INVALID, "conversation_id is required"),
    ("oversized conversation", _set("conversation_id", TOO_LONG), INVALID, "at most"),
    ("empty engine id", _set("engine_id", ""), INVALID, "engine_id is required"),
    ("empty engine request id", _set("engine_request_id", ""), INVALID, "engine_request_id is required"),
    ("turn zero", _set("turn", 0), INVALID, "turns are numbered from 1"),
    ("negative turn", _set("turn", -3), INVALID, "turns are numbered from 1"),
    ("no blocks", _clear_blocks, INVALID, "block_ids is empty"),
    ("negative block id", _negative_block, INVALID, "negative block id"),
    ("zero tokens", _set("num_tokens", 0), INVALID, "num_tokens"),
    ("a digest missing", _drop_digest, INVALID, "one digest each"),
    ("a digest too many", _extra_digest, INVALID, "one digest each"),
    ("more digests than blocks", _more_digests_than_blocks, INVALID, "never more digests than blocks"),
    ("digest of the wrong size", _short_digest, INVALID, "digests are 16 bytes"),
    ("a block generation missing", _a_generation_missing, INVALID, "one per block, or none"),
    ("a block generation too large", _a_generation_too_large, INVALID, "at most 2**53 - 1"),
    ("tier not a MemoryTier", _set("tier", 7), INVALID, "retention.tier is 7, not a MemoryTier"),
    (
        "relocation of itself",
        _relocation("", resources.MEMORY_TIER_HOST),
        INVALID,
        "is its own engine_request_id",
    ),
    (
        "relocation without a tier",
        _relocation("req-x", resources.MEMORY_TIER_UNSPECIFIED),
        INVALID,
        "names no tier",
    ),
    ("relocation of a bad id", _relocation("a/b", resources.MEMORY_TIER_HOST), INVALID, "characters outside"),
    ("negative ttl", _set("ttl_seconds", -1), INVALID, "positive number"),
    ("ttl above the cap", _set("ttl_seconds", 3601), INVALID, "at most 3600"),
    (
        "unknown engine",
        _set("engine_id", "no-such-engine"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "RegisterEngine",
    ),
]


@pytest.mark.parametrize(
    ("edit", "code", "message"),
    [case[1:] for case in PUBLISH_CASES],
    ids=[case[0] for case in PUBLISH_CASES],
)
async def test_bad_publish_is_refused_and_writes_nothing(
    registry: RegistryHandle, edit: RetentionEdit, code: grpc.StatusCode, message: str
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    bad = retention(tenant, conversation, engine_id)
    edit(bad)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await publish(stub, bad)
    assert caught.value.code() == code
    assert message in (caught.value.details() or "")
    assert await status_of(get(stub, tenant, conversation)) == grpc.StatusCode.NOT_FOUND


def _engine_with(**fields: object) -> resources.Engine:
    item = engine("engine-x")
    for name, value in fields.items():
        if isinstance(value, resources.EngineStats):
            item.stats.CopyFrom(value)
        else:
            setattr(item, name, value)
    return item


REGISTER_CASES: list[tuple[str, resources.Engine, int, str]] = [
    ("empty engine id", _engine_with(engine_id=""), 0, "engine_id is required"),
    ("oversized engine id", _engine_with(engine_id=TOO_LONG), 0, "at most"),
    ("engine id with a space", _engine_with(engine_id="a b"), 0, "characters outside"),
    ("no role", _engine_with(role=resources.ENGINE_ROLE_UNSPECIFIED), 0, "engine.role is required"),
    ("no endpoint", _engine_with(http_endpoint=""), 0, "http_endpoint is required"),
    ("zero block size", _engine_with(block_size=0), 0, "block_size"),
    ("port out of range", _engine_with(nixl_port=70000), 0, "not a TCP port"),
    ("negative capacity", _engine_with(kv_capacity_blocks=-1), 0, "cannot be negative"),
    ("endpoint not a URL", _engine_with(http_endpoint="not a url"), 0, "must start with http"),
    ("endpoint port not a number", _engine_with(http_endpoint="http://10.0.0.7:80x"), 0, "is not a URL"),
    ("endpoint without a host", _engine_with(http_endpoint="http://:8000"), 0, "names no valid host"),
    ("endpoint with credentials", _engine_with(http_endpoint="http://u:p@10.0.0.7:8000"), 0, "credentials"),
    ("nixl host not a host", _engine_with(nixl_host="10.0.0.7; rm"), 0, "nixl_host"),
    ("model not printable", _engine_with(model="qwen\n"), 0, "engine.model"),
    (
        "NaN stats",
        _engine_with(stats=resources.EngineStats(prefill_tokens_per_second=float("nan"))),
        0,
        "stats.prefill_tokens_per_second is nan",
    ),
    ("negative ttl", engine("engine-x"), -5, "positive number"),
    ("ttl above the cap", engine("engine-x"), 301, "at most 300"),
]


def test_good_endpoints_and_hosts_pass() -> None:
    for endpoint in ("http://127.0.0.1:8100", "https://decode-0.llm.svc:8000/", "http://[::1]:8000"):
        validation.http_endpoint(endpoint)
    for host in ("10.0.0.7", "::1", "[fd00::1]", "decode-0.decode.llm.svc.cluster.local"):
        assert validation.is_host(host), host
    assert not validation.is_host("a_b") and not validation.is_host("-a")


@pytest.mark.parametrize(
    ("stats", "message"),
    [
        (resources.EngineStats(transfer_bytes_per_second=float("inf")), "transfer_bytes_per_second is inf"),
        (resources.EngineStats(inflight_prefill_tokens=-1), "inflight_prefill_tokens is -1"),
        (
            resources.EngineStats(peer_pull_rates=[resources.PeerPullRate(peer_engine_id="p", pulls=-2)]),
            "peer_pull_rates[0].pulls is -2",
        ),
        (
            resources.EngineStats(peer_pull_rates=[resources.PeerPullRate(peer_engine_id="p", tier=7)]),  # type: ignore[arg-type]
            "peer_pull_rates[0].tier is 7, not a MemoryTier",
        ),
        (
            resources.EngineStats(peer_pull_rates=[resources.PeerPullRate(peer_engine_id="a b")]),
            "peer_engine_id",
        ),
    ],
)
async def test_bad_heartbeat_stats_are_invalid_argument(
    registry: RegistryHandle, stats: resources.EngineStats, message: str
) -> None:
    engine_id = unique("engine")
    registered = await registry.stub().RegisterEngine(
        api.RegisterEngineRequest(engine=engine(engine_id)), timeout=5
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await registry.stub().HeartbeatEngine(
            api.HeartbeatEngineRequest(engine_id=engine_id, stats=stats, incarnation=registered.incarnation),
            timeout=5,
        )
    assert caught.value.code() == INVALID
    assert message in (caught.value.details() or "")


@pytest.mark.parametrize(
    ("item", "ttl", "message"),
    [case[1:] for case in REGISTER_CASES],
    ids=[case[0] for case in REGISTER_CASES],
)
async def test_bad_registration_is_invalid_argument(
    registry: RegistryHandle, item: resources.Engine, ttl: int, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await registry.stub().RegisterEngine(
            api.RegisterEngineRequest(engine=item, ttl_seconds=ttl), timeout=5
        )
    assert caught.value.code() == INVALID
    assert message in (caught.value.details() or "")


LOOKUP_CASES = [
    ("", "c-1", "tenant is required"),
    ("t-1", "", "conversation_id is required"),
    (TOO_LONG, "c-1", "at most"),
    ("t-1", "c/1", "characters outside"),
]


@pytest.mark.parametrize(("tenant", "conversation", "message"), LOOKUP_CASES)
@pytest.mark.parametrize("method", ["GetRetention", "RenewRetention", "ReleaseRetention"])
async def test_bad_conversation_keys_are_invalid_argument(
    registry: RegistryHandle, method: str, tenant: str, conversation: str, message: str
) -> None:
    request_type = getattr(api, f"{method}Request")
    call = getattr(registry.stub(), method)(
        request_type(tenant=tenant, conversation_id=conversation), timeout=5
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == INVALID
    assert message in (caught.value.details() or "")


@pytest.mark.parametrize(
    "reason", [resources.RELEASE_REASON_SUPERSEDED, resources.RELEASE_REASON_ENGINE_GONE, 42]
)
async def test_release_reasons_reserved_to_the_registry_are_refused(
    registry: RegistryHandle, reason: int
) -> None:
    request = api.ReleaseRetentionRequest(tenant="t-1", conversation_id="c-1", reason=reason)  # type: ignore[arg-type]
    assert await status_of(registry.stub().ReleaseRetention(request, timeout=5)) == INVALID


async def test_bad_engine_ids_elsewhere_are_invalid_argument(registry: RegistryHandle) -> None:
    stub = registry.stub()
    assert (
        await status_of(stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=""), timeout=5)) == INVALID
    )
    assert (
        await status_of(stub.DeregisterEngine(api.DeregisterEngineRequest(engine_id="a/b"), timeout=5))
        == INVALID
    )
    assert await status_of(stub.ListEngines(api.ListEnginesRequest(page_size=-1), timeout=5)) == INVALID
    watch = stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=""), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for _ in watch:
            pass
    assert caught.value.code() == INVALID


async def test_unknown_things_are_not_found(registry: RegistryHandle) -> None:
    stub = registry.stub()
    missing = grpc.StatusCode.NOT_FOUND
    assert (
        await status_of(stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id="ghost"), timeout=5))
        == missing
    )
    assert await status_of(get(stub, unique("tenant"), "c-1")) == missing
    renew = stub.RenewRetention(
        api.RenewRetentionRequest(tenant=unique("tenant"), conversation_id="c"), timeout=5
    )
    assert await status_of(renew) == missing


async def test_watching_an_engine_not_registered_yet_is_allowed(registry: RegistryHandle) -> None:
    """A sidecar may open its watch before it registers."""
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    async with await EventStream.open(
        stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id))
    ) as watch:
        await register(stub, engine_id)
        await publish(stub, retention(tenant, conversation, engine_id))
        await stub.ReleaseRetention(
            api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )
        event = await watch.next()
    assert event.reason == resources.RELEASE_REASON_RELEASED
