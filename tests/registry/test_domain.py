"""The registry's domain pieces without a server: validation, keys, records, errors, event reasons, CLI."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from kvferry.registry import validation
from kvferry.registry.cli import config_from_args, configure
from kvferry.registry.config import RegistryConfig, TtlPolicy
from kvferry.registry.errors import EtcdFailure, EtcdUnavailable
from kvferry.registry.etcd import EtcdGateway, EtcdSettings, EventType, KeyValue, WatchEvent, grpc_target
from kvferry.registry.events import RetentionEventHub
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.records import (
    decode_incarnation,
    decode_record,
    decode_tombstone,
    encode_incarnation,
    encode_record,
    encode_tombstone,
)
from kvferry.registry.server import HistoryCompactor
from kvferry.runtime.clock import ManualClock
from kvferry.runtime.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ServiceError,
    grpc_code,
)
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources

from tests.registry.builders import engine, retention

# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound("x"), grpc.StatusCode.NOT_FOUND),
        (FailedPrecondition("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (Aborted("x"), grpc.StatusCode.ABORTED),
        (EtcdUnavailable("x"), grpc.StatusCode.UNAVAILABLE),
        (EtcdFailure("x"), grpc.StatusCode.INTERNAL),
        (ServiceError("x"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_has_one_status(error: ServiceError, code: grpc.StatusCode) -> None:
    assert grpc_code(error) == code


# --- validation -------------------------------------------------------------------------------


def test_ttl_zero_takes_the_default_and_bounds_are_enforced() -> None:
    policy = TtlPolicy(default_retention_ttl_seconds=30, max_retention_ttl_seconds=60)
    assert validation.retention_ttl(0, policy) == 30
    assert validation.retention_ttl(60, policy) == 60
    with pytest.raises(InvalidArgument, match="at most 60"):
        validation.retention_ttl(61, policy)
    with pytest.raises(InvalidArgument, match="positive"):
        validation.retention_ttl(-1, policy)


def test_ttl_policy_rejects_a_default_above_its_cap() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        TtlPolicy(default_retention_ttl_seconds=100, max_retention_ttl_seconds=50)


def test_digest_count_is_checked_against_the_engines_block_size() -> None:
    item = retention("t", "c", "e", num_tokens=40)  # block size 16: 2 full blocks, 3 blocks held
    validation.validate_retention_shape(item)
    validation.validate_against_engine(item, engine("e"))
    other = engine("e")
    other.block_size = 8  # 40 tokens would be 5 full blocks
    with pytest.raises(InvalidArgument, match="make 5 full blocks"):
        validation.validate_against_engine(item, other)


def test_an_oversized_record_is_refused() -> None:
    item = retention("t", "c", "e")
    item.block_ids.extend(range(600_000))
    with pytest.raises(InvalidArgument, match="at most"):
        validation.validate_retention_shape(item)


@pytest.mark.parametrize(
    ("requested", "page"), [(0, validation.DEFAULT_PAGE_SIZE), (5, 5), (10_000, validation.MAX_PAGE_SIZE)]
)
def test_page_size(requested: int, page: int) -> None:
    assert validation.page_size(requested) == page


def test_page_tokens_round_trip_and_garbage_is_refused() -> None:
    assert validation.decode_page_token(validation.encode_page_token("engine-7")) == "engine-7"
    for garbage in ("***", validation.encode_page_token("a/b"), validation.encode_page_token("")):
        with pytest.raises(InvalidArgument, match="page_token"):
            validation.decode_page_token(garbage)


# --- keys and records -------------------------------------------------------------------------


def test_key_layout_scopes_retentions_by_tenant_and_parses_back() -> None:
    layout = KeyLayout("/p/")
    conversation = ConversationKey("acme", "c-1")
    assert layout.live(conversation) == b"/p/retention/live/acme/c-1"
    assert layout.live(ConversationKey("other", "c-1")) != layout.live(conversation)
    assert layout.conversation_of_live(layout.live(conversation)) == conversation
    assert layout.conversation_of_tombstone(layout.tombstone(conversation)) == conversation
    assert layout.index_entry_of(layout.engine_index("e-1", conversation)) == ("e-1", conversation)
    assert layout.engine_id_of(layout.engine("e-1")) == "e-1"
    # One watch range covers live records and tombstones, and nothing else.
    for key in (layout.live(conversation), layout.tombstone(conversation)):
        assert key.startswith(layout.retention_events)
    assert not layout.engine_index("e-1", conversation).startswith(layout.retention_events)
    with pytest.raises(ValueError, match="must end with"):
        KeyLayout("/p")


def test_records_round_trip() -> None:
    item = retention("t", "c", "e", turn=4)
    stored = decode_record(encode_record(item, 0x1234))
    assert stored.retention == item and stored.engine_incarnation == 0x1234
    assert decode_tombstone(encode_tombstone(resources.RELEASE_REASON_EVICTED, 12.5)) == (
        resources.RELEASE_REASON_EVICTED,
        12.5,
    )
    assert decode_incarnation(encode_incarnation(99)) == 99
    with pytest.raises(ValueError, match="not a retention record"):
        decode_record(b"XX" + bytes(8))


# --- how endings get their reason -------------------------------------------------------------


def _put(kv: KeyValue, previous: KeyValue | None = None) -> WatchEvent:
    return WatchEvent(EventType.PUT, kv, previous)


def _delete(key: bytes, revision: int, previous: KeyValue) -> WatchEvent:
    return WatchEvent(EventType.DELETE, KeyValue(key, b"", 0, revision), previous)


async def test_endings_are_classified_from_one_revisions_events() -> None:
    layout = KeyLayout("/p/")
    hub = RetentionEventHub(EtcdGateway(EtcdSettings()), layout, clock=ManualClock(wall=100.0))
    conversation = ConversationKey("t", "c")
    live = layout.live(conversation)
    turn1 = encode_record(retention("t", "c", "e", turn=1), 7)
    turn2 = encode_record(retention("t", "c", "e", turn=2), 7)
    async with hub.attach("e") as subscription:
        hub._dispatch(  # the gateway's watch events, as one revision would bring them
            [
                _put(KeyValue(live, turn1, 11, 5), KeyValue(live, turn1, 11, 4)),  # renewed
                _put(KeyValue(live, turn2, 12, 6), KeyValue(live, turn1, 11, 5)),  # superseded
                _put(
                    KeyValue(
                        layout.tombstone(conversation),
                        encode_tombstone(resources.RELEASE_REASON_RELEASED, 50.0),
                        12,
                        7,
                    )
                ),
                _delete(live, 7, KeyValue(live, turn2, 12, 6)),  # released
                _delete(live, 9, KeyValue(live, turn2, 12, 8)),  # expired
            ],
            0,
        )
        queued = [subscription.queue.get_nowait() for _ in range(4)]
    assert subscription.queue.empty()
    got = [event for event in queued if event is not None]
    assert len(got) == 4
    assert [(e.type, e.reason, e.retention.turn, e.revision) for e in got] == [
        (api.RETENTION_EVENT_TYPE_RENEWED, resources.RELEASE_REASON_UNSPECIFIED, 1, 5),
        (api.RETENTION_EVENT_TYPE_ENDED, resources.RELEASE_REASON_SUPERSEDED, 1, 6),
        (api.RETENTION_EVENT_TYPE_ENDED, resources.RELEASE_REASON_RELEASED, 2, 7),
        (api.RETENTION_EVENT_TYPE_ENDED, resources.RELEASE_REASON_EXPIRED, 2, 9),
    ]
    assert got[2].end_time == 50.0 and got[3].end_time == 100.0
    await asyncio.sleep(0)


# --- configuration ----------------------------------------------------------------------------


def test_grpc_target_joins_several_ip_endpoints() -> None:
    assert grpc_target(["127.0.0.1:2379"]) == ("127.0.0.1", 2379)
    assert grpc_target(["127.0.0.1:2379", "127.0.0.1:22379"]) == ("ipv4:127.0.0.1:2379,127.0.0.1", 22379)
    assert grpc_target(["localhost:2379", "127.0.0.1:1"]) == ("localhost", 2379)
    with pytest.raises(ValueError, match="host:port"):
        grpc_target(["nowhere"])


def _parse(argv: list[str], environ: dict[str, str]) -> RegistryConfig:
    parser = argparse.ArgumentParser()
    configure(parser, environ)
    return config_from_args(parser.parse_args(argv))


def test_flags_and_environment_fill_the_config_and_flags_win() -> None:
    environ = {
        "KVFERRY_ETCD_ENDPOINTS": "127.0.0.1:1,127.0.0.1:2",
        "KVFERRY_MAX_RETENTION_TTL_SECONDS": "900",
        "KVFERRY_REGISTRY_LISTEN": "127.0.0.1:7000",
    }
    config = _parse(["--listen", "127.0.0.1:0", "--key-prefix", "/x/"], environ)
    assert config.listen_address == "127.0.0.1:0"
    assert config.etcd_endpoints == ("127.0.0.1:1", "127.0.0.1:2")
    assert config.ttl.max_retention_ttl_seconds == 900
    assert config.key_prefix == "/x/"
    assert _parse([], {}) == RegistryConfig()
    with pytest.raises(ValueError, match="must end with"):
        _parse(["--key-prefix", "/x"], {})


def test_help_documents_every_flag_and_its_environment_variable() -> None:
    parser = argparse.ArgumentParser()
    configure(parser, {})
    text = parser.format_help()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "[env KVFERRY_" in action.help, action.dest
        assert action.option_strings[0] in text


def test_history_is_compacted_only_past_the_time_kept() -> None:
    compactor = HistoryCompactor(keep_seconds=60)
    assert compactor.observe(0.0, 100) is None
    assert compactor.observe(30.0, 200) is None
    assert compactor.observe(60.0, 300) == 100  # the mark from 60 s ago
    assert compactor.observe(95.0, 400) == 200
    assert compactor.observe(96.0, 401) is None
