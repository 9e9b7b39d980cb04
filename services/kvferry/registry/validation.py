"""Checks on what callers send, with messages that say how to fix the request.

Pure functions: they raise ``InvalidArgument`` and never touch etcd.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import re
from urllib.parse import urlsplit

from kvferry.pd.digest import DIGEST_BYTES
from kvferry.pd.kvferry_params import MAX_GENERATION
from kvferry.registry.config import TtlPolicy
from kvferry.registry.keys import ConversationKey
from kvferry.runtime.errors import InvalidArgument
from kvferry.runtime.ids import check_id
from kvferry.v1 import resources_pb2 as resources

# etcd refuses requests above 1.5 MiB by default; keep one record well inside that.
MAX_RECORD_BYTES = 1024 * 1024
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100
# Renewals one RenewRetentions call may carry.
MAX_RENEWAL_BATCH = 1000

# A DNS name (RFC 1123 labels); IP addresses are checked by ipaddress.
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)
MAX_MODEL_NAME = 256
_VALID_ROLES = (resources.ENGINE_ROLE_PREFILL, resources.ENGINE_ROLE_DECODE, resources.ENGINE_ROLE_BOTH)


def require_id(kind: str, value: str) -> str:
    problem = check_id(kind, value)
    if problem is not None:
        raise InvalidArgument(problem)
    return value


def conversation_key(tenant: str, conversation_id: str) -> ConversationKey:
    return ConversationKey(require_id("tenant", tenant), require_id("conversation_id", conversation_id))


def resolve_ttl(kind: str, requested: int, default: int, maximum: int) -> int:
    """The TTL to grant: ``requested``, or ``default`` when 0."""
    if requested == 0:
        return default
    if requested < 0:
        raise InvalidArgument(
            f"{kind} ttl_seconds is {requested}; use a positive number, or 0 for the default"
        )
    if requested > maximum:
        raise InvalidArgument(
            f"{kind} ttl_seconds is {requested}; the registry allows at most {maximum} s "
            "(renew more often instead, or raise the operator's cap)"
        )
    return requested


def engine_ttl(requested: int, policy: TtlPolicy) -> int:
    return resolve_ttl("engine", requested, policy.default_engine_ttl_seconds, policy.max_engine_ttl_seconds)


def retention_ttl(requested: int, policy: TtlPolicy) -> int:
    return resolve_ttl(
        "retention", requested, policy.default_retention_ttl_seconds, policy.max_retention_ttl_seconds
    )


def turn_ttl(requested: int, policy: TtlPolicy) -> int:
    return resolve_ttl("turn", requested, policy.default_turn_ttl_seconds, policy.max_turn_ttl_seconds)


def validate_engine(engine: resources.Engine) -> None:
    require_id("engine.engine_id", engine.engine_id)
    if engine.role not in _VALID_ROLES:
        raise InvalidArgument(
            "engine.role is required: ENGINE_ROLE_PREFILL, ENGINE_ROLE_DECODE or ENGINE_ROLE_BOTH"
        )
    http_endpoint(engine.http_endpoint)
    if engine.nixl_host and not is_host(engine.nixl_host):
        raise InvalidArgument(
            f"engine.nixl_host {engine.nixl_host[:80]!r} is neither an IP address nor a DNS name; give the "
            "address peers reach the engine's NIXL side channel on"
        )
    if len(engine.model) > MAX_MODEL_NAME or not engine.model.isprintable():
        raise InvalidArgument(
            f"engine.model must be printable and at most {MAX_MODEL_NAME} characters "
            "(the served model's name)"
        )
    if engine.block_size <= 0:
        raise InvalidArgument(
            f"engine.block_size is {engine.block_size}; give the engine's tokens per KV block (> 0)"
        )
    if not 0 <= engine.nixl_port <= 65535:
        raise InvalidArgument(f"engine.nixl_port {engine.nixl_port} is not a TCP port (0-65535)")
    if engine.kv_capacity_blocks < 0:
        raise InvalidArgument(
            f"engine.kv_capacity_blocks is {engine.kv_capacity_blocks}; it cannot be negative"
        )
    if engine.max_model_len < 0:
        raise InvalidArgument(f"engine.max_model_len is {engine.max_model_len}; it cannot be negative")
    release_grace(engine.release_grace_seconds, "engine.release_grace_seconds")
    if engine.HasField("stats"):
        engine_stats(engine.stats, "engine.stats")


def is_host(text: str) -> bool:
    """An IP address (IPv6 with or without brackets) or a DNS name."""
    try:
        ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return _HOSTNAME.fullmatch(text) is not None
    return True


def http_endpoint(text: str) -> str:
    """``http(s)://host[:port]`` (a path is allowed; credentials, queries and fragments are not)."""
    example = "e.g. 'http://10.0.0.7:8000'"
    if not text:
        raise InvalidArgument(f"engine.http_endpoint is required, {example}")
    shown = repr(text[:80])
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        raise InvalidArgument(f"engine.http_endpoint {shown} is not a URL, {example}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidArgument(f"engine.http_endpoint {shown} must start with http:// or https://, {example}")
    if not parts.hostname or not is_host(parts.hostname):
        raise InvalidArgument(f"engine.http_endpoint {shown} names no valid host, {example}")
    if parts.username is not None or parts.query or parts.fragment:
        raise InvalidArgument(
            f"engine.http_endpoint {shown} may not carry credentials, a query or a fragment, {example}"
        )
    return text


def engine_stats(stats: resources.EngineStats, name: str) -> None:
    """Every figure finite and not negative: the router's cost model and placement read them as such."""
    figures: list[tuple[str, float]] = [
        (field.name, getattr(stats, field.name))
        for field in stats.DESCRIPTOR.fields
        if field.message_type is None  # the numbers; peer_pull_rates below
    ]
    for index, rate in enumerate(stats.peer_pull_rates):
        require_id(f"{name}.peer_pull_rates[{index}].peer_engine_id", rate.peer_engine_id)
        if rate.tier not in resources.MemoryTier.values():
            raise InvalidArgument(
                f"{name}.peer_pull_rates[{index}].tier is {rate.tier}, not a MemoryTier; use {_TIERS}"
            )
        figures += [
            (f"peer_pull_rates[{index}].bytes_per_second", rate.bytes_per_second),
            (f"peer_pull_rates[{index}].pulls", rate.pulls),
        ]
    for field_name, value in figures:
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(
                f"{name}.{field_name} is {value}; engine stats must be finite and not negative"
            )


def release_grace(seconds: float, name: str) -> None:
    """A release grace is a finite number of seconds, 0 meaning not known."""
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(
            f"{name} is {seconds}; give the engine connector's release_grace_seconds (> 0), or 0 if not known"
        )


def validate_retention_shape(retention: resources.Retention) -> ConversationKey:
    """Checks everything that does not depend on the engine; returns the conversation key."""
    conversation = conversation_key(retention.tenant, retention.conversation_id)
    require_id("retention.engine_id", retention.engine_id)
    require_id("retention.engine_request_id", retention.engine_request_id)
    if retention.turn < 1:
        raise InvalidArgument(f"retention.turn is {retention.turn}; turns are numbered from 1")
    if not retention.block_ids:
        raise InvalidArgument("retention.block_ids is empty; publish the block ids the engine keeps")
    if any(block_id < 0 for block_id in retention.block_ids):
        raise InvalidArgument("retention.block_ids has a negative block id")
    if retention.num_tokens <= 0:
        raise InvalidArgument(f"retention.num_tokens is {retention.num_tokens}; it must be positive")
    if len(retention.block_digests) > len(retention.block_ids):
        raise InvalidArgument(
            f"retention has {len(retention.block_digests)} block_digests for {len(retention.block_ids)} "
            "block_ids; "
            "there is one digest per full block, so never more digests than blocks"
        )
    if retention.block_generations and len(retention.block_generations) != len(retention.block_ids):
        raise InvalidArgument(
            f"retention has {len(retention.block_generations)} block_generations for "
            f"{len(retention.block_ids)} block_ids; publish one per block, or none"
        )
    for index, generation in enumerate(retention.block_generations):
        if generation > MAX_GENERATION:
            raise InvalidArgument(
                f"retention.block_generations[{index}] is {generation}; generations are at most 2**53 - 1 "
                "so the JSON that carries them to prefill engines keeps them exact "
                "(kvferry.connector.generations starts them below 2**52)"
            )
    for index, digest in enumerate(retention.block_digests):
        if len(digest) != DIGEST_BYTES:
            raise InvalidArgument(
                f"retention.block_digests[{index}] is {len(digest)} bytes; digests are {DIGEST_BYTES} bytes "
                "(kvferry.pd.digest.block_digests)"
            )
    memory_tier(retention)
    size = retention.ByteSize()
    if size > MAX_RECORD_BYTES:
        raise InvalidArgument(
            f"retention is {size} bytes; the registry stores at most {MAX_RECORD_BYTES} bytes per retention"
        )
    return conversation


_TIERS = "MEMORY_TIER_DEVICE (the KV cache) or MEMORY_TIER_HOST (the engine's host pool)"


def memory_tier(retention: resources.Retention) -> None:
    """The tier is one ``MemoryTier`` names; a relocation names the tier it moved to and another request."""
    if retention.tier not in resources.MemoryTier.values():
        raise InvalidArgument(f"retention.tier is {retention.tier}, not a MemoryTier; use {_TIERS}")
    relocates = retention.relocates_engine_request_id
    if not relocates:
        return
    require_id("retention.relocates_engine_request_id", relocates)
    if relocates == retention.engine_request_id:
        raise InvalidArgument(
            f"retention.relocates_engine_request_id is its own engine_request_id {relocates!r}; a relocation "
            "publishes the moved blocks under a new engine_request_id and names the live one it replaces"
        )
    if retention.tier == resources.MEMORY_TIER_UNSPECIFIED:
        raise InvalidArgument(
            f"retention relocates engine request {relocates!r} but names no tier; say where the blocks "
            f"moved: {_TIERS}"
        )


def validate_against_engine(retention: resources.Retention, engine: resources.Engine) -> None:
    """Checks that need the holding engine's block size."""
    expected = retention.num_tokens // engine.block_size
    if len(retention.block_digests) != expected:
        raise InvalidArgument(
            f"retention has {len(retention.block_digests)} block_digests; {retention.num_tokens} tokens at "
            f"engine {engine.engine_id}'s block_size {engine.block_size} make {expected} full blocks, "
            "one digest each"
        )


def release_reason(requested: resources.ReleaseReason.ValueType) -> resources.ReleaseReason.ValueType:
    if requested == resources.RELEASE_REASON_UNSPECIFIED:
        return resources.RELEASE_REASON_RELEASED
    if requested in (resources.RELEASE_REASON_RELEASED, resources.RELEASE_REASON_EVICTED):
        return requested
    name = (
        resources.ReleaseReason.Name(requested)
        if requested in resources.ReleaseReason.values()
        else requested
    )
    raise InvalidArgument(
        f"release reason {name} is not for callers; use RELEASE_REASON_RELEASED (default) or "
        "RELEASE_REASON_EVICTED"
    )


# What an engine may give as the reason it let a retention go (EndEngineRetention).
_ENGINE_END_REASONS = (
    resources.RELEASE_REASON_RELEASED,
    resources.RELEASE_REASON_EVICTED,
    resources.RELEASE_REASON_SUPERSEDED,
    resources.RELEASE_REASON_HARD_CAP,
)


def engine_end_reason(requested: resources.ReleaseReason.ValueType) -> resources.ReleaseReason.ValueType:
    if requested == resources.RELEASE_REASON_UNSPECIFIED:
        return resources.RELEASE_REASON_RELEASED
    if requested in _ENGINE_END_REASONS:
        return requested
    name = (
        resources.ReleaseReason.Name(requested)
        if requested in resources.ReleaseReason.values()
        else requested
    )
    raise InvalidArgument(
        f"release reason {name} is not one an engine gives; use RELEASE_REASON_EVICTED, "
        "RELEASE_REASON_HARD_CAP, RELEASE_REASON_SUPERSEDED or RELEASE_REASON_RELEASED (default)"
    )


def page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidArgument(
            f"page_size is {requested}; use a positive number, or 0 for {DEFAULT_PAGE_SIZE}"
        )
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


def encode_page_token(engine_id: str) -> str:
    """The ListEngines page token that resumes after ``engine_id``."""
    return base64.urlsafe_b64encode(engine_id.encode()).decode()


def decode_page_token(token: str) -> str:
    try:
        engine_id = base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        engine_id = ""
    if check_id("page_token", engine_id) is not None:
        raise InvalidArgument("page_token is not one this registry issued; list again without it")
    return engine_id


def renewal_batch(count: int) -> None:
    """A RenewRetentions call carries 1..MAX_RENEWAL_BATCH renewals."""
    if not 0 < count <= MAX_RENEWAL_BATCH:
        raise InvalidArgument(
            f"renewals carries {count} conversations; send 1 to {MAX_RENEWAL_BATCH} per call "
            "(split larger sets into several calls)",
            param="renewals",
        )
