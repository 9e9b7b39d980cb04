"""kvferry's own keys in vLLM's ``kv_transfer_params``: the one typed, versioned definition.

The router (or any client) writes them; the kvferry connector inside vLLM reads them. Requests without
them behave exactly as with vLLM's NixlConnector. vLLM's own keys, which share the dict, are in
:mod:`kvferry.pd.vllm_params`.

Wire forms (JSON, inside ``kv_transfer_params``)::

    decode, retain for the conversation:  "kvferry": {"tenant": "acme", "conversation_id": "c-42", "turn": 3}
    decode, free the blocks at finish:    "kvferry": {"retain": false}
    prefill pulling a retention:          "kvferry_read_ms": 8500  (beside vLLM's remote_* keys; with the
                                          conversation mark when the turn has one)
    the generations of the reused blocks: "kvferry_generations": [4503599627370497, ...]  (beside vLLM's
                                          remote_block_ids, one per block)
    where the reused blocks are:          "kvferry_tier": "host"  (the holder's host pool; absent: its KV
                                          cache)
    per-request pull options (tests):     "kvferry_pull": {"coalesce": false, "digest": true}
    the engine the turn's KV goes to:     "kvferry_peer": {"engine_id": "decode-0", "host": "10.0.0.7",
                                          "port": 5600}  (on a prefill: handshake with it ahead)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#
# kvferry's kv_transfer_params version
#
# Increment it with every change to a key below, its shape or its meaning, and add a line here. Engines and
# routers of different versions may disagree about a request: deploy the connector first, it accepts every
# earlier form.
#
# Version history:
#   1: the "kvferry" mark {tenant, conversation_id, turn} on decode requests: D retains the finished
#      request's blocks for the conversation and reports them to its sidecar.
#   2: "lease_expire_time" (unix seconds) inside the mark of a prefill request that reuses a retention:
#      the latest time P may start reading it; P declines the pull (and recomputes) when too near.
#   3: "kvferry_pull" {coalesce, digest}: per-request pull options (vLLM's descriptors for one request,
#      a digest of the received bytes in the pull's log line).
#   4: the release mark {"retain": false} on decode requests: D frees the blocks as the request finishes.
#   5: "kvferry_read_ms" (integer milliseconds) on every prefill request that pulls a retention, with or
#      without a mark (retain=false turns too): how long P may still start reading it, counted from the
#      retention's lookup and sent as the time left, never as a wall-clock instant (clocks of different
#      machines disagree). P's connector turns it into its own monotonic deadline from the request's
#      arrival and checks it when it schedules the pull and again when it posts the READ. Replaces
#      "lease_expire_time", which the connector still honours from older clients when this key is absent.
#   6: "kvferry_generations" [int, ...] on a prefill request that pulls a retention: the generations its
#      record published, one per entry of remote_block_ids; P reads them again from D after the pull and
#      recomputes on any difference (pull-time fencing). Absent: no check (earlier routers).
#   7: "kvferry_tier" ("device" or "host") on a prefill request that pulls a retention: which of the holder's
#      tiers the blocks are in. The pull is the same either way; P keeps its measured pull rate per peer and
#      tier (the router's cost model reads them). Absent: the KV cache.
#   8: "kvferry_peer" {engine_id, host, port} on a prefill request: the decode engine this turn's KV goes to,
#      which will hold the conversation's retention (its NIXL side channel). P's connector starts its NIXL
#      handshake with that engine in the background unless it has one, so the next turn's pull from it does
#      not wait for the handshake (0.7-0.9 s on an H100). Absent: P handshakes at its first pull, as vLLM
#      does.
#
KVFERRY_PARAMS_VERSION: int = 8

# The mark: which conversation a request belongs to, or that nothing will reuse it.
MARK_KEY = "kvferry"
RETAIN_KEY = "retain"
# On a prefill request that pulls a retention: milliseconds left to start reading it (version 5). Clients
# send :meth:`kvferry.pd.reuse.ReadWindow.ms_left`: a window opened when the retention was looked up, never
# past its lease end, and safely under the holder's release grace, so a retention released meanwhile is
# still intact when P reads it (rule 1 of docs/design.md). The prefill engine's connector declines the pull
# (and recomputes) when less than its ``min_read_seconds`` is left.
READ_MS_KEY = "kvferry_read_ms"
# Version 2's form of the same deadline, inside the mark: unix seconds. Older clients only; the connector
# reads it when READ_MS_KEY is absent.
LEASE_EXPIRE_KEY = "lease_expire_time"
# Per-request pull options, beside the mark.
PULL_OPTIONS_KEY = "kvferry_pull"
# The published generations of the blocks a prefill pulls, beside vLLM's remote_block_ids (one per block).
GENERATIONS_KEY = "kvferry_generations"
# Where the blocks a prefill pulls are on their holder: one of PULL_TIERS.
TIER_KEY = "kvferry_tier"
DEVICE_TIER, HOST_TIER = "device", "host"
PULL_TIERS = (DEVICE_TIER, HOST_TIER)
# On a prefill request: the engine P will pull from next (version 8).
PEER_KEY = "kvferry_peer"
# Generations are below 2**53 so that every JSON parser (IEEE doubles included) carries them exactly.
MAX_GENERATION = 2**53 - 1

_CONVERSATION_FIELDS = ("tenant", "conversation_id", "turn")


@dataclass(frozen=True)
class ConversationMark:
    tenant: str
    conversation_id: str
    turn: int

    def to_params(self) -> dict[str, Any]:
        return {MARK_KEY: {"tenant": self.tenant, "conversation_id": self.conversation_id, "turn": self.turn}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> ConversationMark | None:
        """The conversation mark in ``params``, or None (absent, or a :class:`ReleaseMark`).
        A malformed mark raises ValueError."""
        mark = parse_mark(params)
        return mark if isinstance(mark, ConversationMark) else None


@dataclass(frozen=True)
class ReleaseMark:
    """Free the decode's blocks when it finishes: nothing will reuse this turn."""

    def to_params(self) -> dict[str, Any]:
        return {MARK_KEY: {RETAIN_KEY: False}}


Mark = ConversationMark | ReleaseMark


def parse_mark(params: Mapping[str, Any] | None) -> Mark | None:
    """The mark in ``params``, or None when absent. A malformed mark raises ValueError."""
    if not params or MARK_KEY not in params:
        return None
    raw = params[MARK_KEY]
    if not isinstance(raw, Mapping):
        raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] must be an object, got {type(raw).__name__}")
    if RETAIN_KEY in raw:
        if raw[RETAIN_KEY] is not False:
            raise ValueError(f"kv_transfer_params[{MARK_KEY!r}][{RETAIN_KEY!r}] may only be false: {raw!r}")
        return ReleaseMark()
    return _conversation_mark(raw)


def _conversation_mark(raw: Mapping[str, Any]) -> ConversationMark:
    try:
        tenant, conversation_id, turn = (raw[name] for name in _CONVERSATION_FIELDS)
    except KeyError as missing:
        raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] lacks {missing}") from None
    if not isinstance(tenant, str) or not isinstance(conversation_id, str) or not isinstance(turn, int):
        raise ValueError(f"kv_transfer_params[{MARK_KEY!r}] has fields of the wrong type: {raw!r}")
    return ConversationMark(tenant=tenant, conversation_id=conversation_id, turn=turn)


def mark_params(mark: Mark | None) -> dict[str, Any]:
    """The mark for ``kv_transfer_params`` (empty without one)."""
    return {} if mark is None else mark.to_params()


def read_ms_params(ms_left: int) -> dict[str, Any]:
    """The read window's time left for ``kv_transfer_params`` of a prefill that pulls."""
    if ms_left < 0:
        raise ValueError(f"the read window's time left must be >= 0 ms, got {ms_left}")
    return {READ_MS_KEY: ms_left}


def read_ms_from_params(params: Mapping[str, Any] | None) -> int | None:
    """Milliseconds a prefill request has left to start reading the retention it pulls; None when absent.
    Raises ValueError when malformed (not a non-negative integer)."""
    raw = (params or {}).get(READ_MS_KEY)
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise ValueError(f"{READ_MS_KEY} must be a non-negative integer (milliseconds), got {raw!r:.100}")
    return raw


def lease_expire_time_from_params(params: Mapping[str, Any] | None) -> float | None:
    """Version 2's read deadline (unix seconds, inside the mark) of a prefill request from an older client."""
    if not params:
        return None
    raw = params.get(MARK_KEY)
    if not isinstance(raw, Mapping):
        return None
    value = raw.get(LEASE_EXPIRE_KEY)
    return None if value is None else float(value)


@dataclass(frozen=True)
class PullOptions:
    """Per-request pull options, ``kv_transfer_params["kvferry_pull"]`` (comparisons and tests).

    ``{"coalesce": false}`` posts this request's pull with vLLM's own descriptors whatever the
    engine's ``coalesce_pulls``; ``{"digest": true}`` logs a SHA-256 of the received KV bytes
    (host memory only) with the pull; ``{"mapped": false}`` reads a holder's host pool over NIXL even
    where the prefill engine has it mapped. Routers send none of them.
    """

    coalesce: bool | None = None
    digest: bool = False
    mapped: bool | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> PullOptions | None:
        """The options in ``params``; None when absent. Raises ValueError when malformed."""
        raw = (params or {}).get(PULL_OPTIONS_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping) or set(raw) - {"coalesce", "digest", "mapped"}:
            shape = '{"coalesce": bool, "digest": bool, "mapped": bool}'
            raise ValueError(f"{PULL_OPTIONS_KEY} must be {shape}, got {raw!r}")
        coalesce, digest, mapped = raw.get("coalesce"), raw.get("digest", False), raw.get("mapped")
        if (
            (coalesce is not None and not isinstance(coalesce, bool))
            or not isinstance(digest, bool)
            or (mapped is not None and not isinstance(mapped, bool))
        ):
            raise ValueError(f"{PULL_OPTIONS_KEY} values must be booleans, got {raw!r}")
        return cls(coalesce=coalesce, digest=digest, mapped=mapped)

    def to_params(self) -> dict[str, Any]:
        body: dict[str, Any] = {"digest": self.digest}
        if self.coalesce is not None:
            body["coalesce"] = self.coalesce
        if self.mapped is not None:
            body["mapped"] = self.mapped
        return {PULL_OPTIONS_KEY: body}


@dataclass(frozen=True)
class BlockGenerations:
    """``kv_transfer_params["kvferry_generations"]``: the generations a retention's record published for the
    blocks a prefill pulls, in the order of vLLM's ``remote_block_ids`` (its first KV-cache group).

    P's connector reads the holder's generations of the pulled blocks after the data arrived and drops the
    pull (recomputing) when any differs: the holder bumps a block's generation before it can reuse it.
    """

    values: tuple[int, ...]

    def to_params(self) -> dict[str, Any]:
        return {GENERATIONS_KEY: list(self.values)}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> BlockGenerations | None:
        """The generations in ``params``; None when absent. Raises ValueError when malformed."""
        raw = (params or {}).get(GENERATIONS_KEY)
        if raw is None:
            return None
        if not isinstance(raw, list | tuple) or not all(
            isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= MAX_GENERATION for g in raw
        ):
            raise ValueError(f"{GENERATIONS_KEY} must be a list of integers in [0, 2**53), got {raw!r:.200}")
        return cls(values=tuple(raw))


def tier_params(tier: str) -> dict[str, Any]:
    """``kv_transfer_params`` saying which of the holder's tiers (one of PULL_TIERS) a pull reads; the KV
    cache, the default, is not written (engines before version 7 see the same params as before)."""
    if tier not in PULL_TIERS:
        raise ValueError(f"{TIER_KEY} must be one of {PULL_TIERS}, got {tier!r:.100}")
    return {} if tier == DEVICE_TIER else {TIER_KEY: tier}


def tier_from_params(params: Mapping[str, Any] | None) -> str:
    """The tier a pull reads (DEVICE_TIER when not said). Raises ValueError when malformed."""
    raw = (params or {}).get(TIER_KEY, DEVICE_TIER)
    if raw not in PULL_TIERS:
        raise ValueError(f"{TIER_KEY} must be one of {PULL_TIERS}, got {raw!r:.100}")
    return str(raw)


@dataclass(frozen=True)
class PeerAddress:
    """``kv_transfer_params["kvferry_peer"]``: an engine a prefill engine will pull from (the turn's decode
    engine, which retains the conversation), where its NIXL side channel listens. P's connector handshakes
    with it ahead of the first pull."""

    engine_id: str
    host: str
    port: int

    def to_params(self) -> dict[str, Any]:
        return {PEER_KEY: {"engine_id": self.engine_id, "host": self.host, "port": self.port}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> PeerAddress | None:
        """The peer in ``params``; None when absent. Raises ValueError when malformed."""
        raw = (params or {}).get(PEER_KEY)
        if raw is None:
            return None
        if not isinstance(raw, Mapping) or set(raw) != {"engine_id", "host", "port"}:
            shape = '{"engine_id": str, "host": str, "port": int}'
            raise ValueError(f"{PEER_KEY} must be {shape}, got {raw!r:.200}")
        engine_id, host, port = raw["engine_id"], raw["host"], raw["port"]
        if (
            not isinstance(engine_id, str)
            or not engine_id
            or not isinstance(host, str)
            or not host
            or not isinstance(port, int)
            or isinstance(port, bool)
            or not 0 < port < 65536
        ):
            raise ValueError(
                f"{PEER_KEY} needs a non-empty engine_id and host and a port in 1..65535, got {raw!r:.200}"
            )
        return cls(engine_id=engine_id, host=host, port=port)
