"""The connector's settings: read once from ``kv_connector_extra_config``, validated at engine start.

Every key is optional except where noted; defaults are chosen for a long-running agent workload.
vLLM's own NixlConnector keys (``bidirectional_kv_xfer``, ``kv_recompute_threshold``,
``kv_lease_duration``, ``backends``, ...) sit in the same dictionary and keep their meaning; the
kvferry keys below are read here and nowhere else. docs/connector.md lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvferry.pd.reuse import max_read_window

# Keys vLLM's NixlConnector reads from the same dictionary (left to vLLM).
VLLM_KEYS = frozenset(
    {
        "bidirectional_kv_xfer",
        "kv_recompute_threshold",
        "decoder_kv_blocks_ttl",
        "kv_lease_duration",
        "backends",
        "num_threads",
        "engine_ttl",
        "enforce_handshake_compat",
    }
)


class SettingsError(ValueError):
    """A setting is missing or invalid; raised at engine start with the fix in the message."""


@dataclass(frozen=True)
class KvferrySettings:
    # gRPC address of the local sidecar ("127.0.0.1:PORT" or "unix:/path"); empty: no sidecar,
    # every retention is held until the hard cap.
    sidecar_address: str = ""
    # Hard cap: a retention is freed at most this long after its last word from the registry
    # (report acknowledged, renewal), even if the sidecar or registry is unreachable (rule 4).
    max_retention_seconds: float = 1800.0
    # After the registry ends a retention, D keeps its blocks this much longer, so a prefill
    # that was handed the retention just before can still read it (rule 1). Published in the
    # engine's registry record; routers hand out read windows of at most half of it
    # (kvferry.pd.reuse.max_read_window).
    release_grace_seconds: float = 30.0
    # Lease length the connector asks for when it reports a retention.
    lease_ttl_seconds: int = 120
    # Budget of retained blocks, as a fraction of the engine's KV cache; past it the least
    # recently used retentions are evicted (and the eviction published).
    retained_kv_fraction: float = 0.5
    # Prefill side: decline a pull (and recompute) when less than this is left before the read
    # deadline the router handed out.
    min_read_seconds: float = 2.0
    # How often engine stats go to the sidecar while they change.
    stats_interval_seconds: float = 5.0
    # Timeout of each unary call to the sidecar. A report or an end takes the sidecar up to two
    # registry calls (5 s each by default): a shorter deadline only makes the connector ask again.
    sidecar_timeout_seconds: float = 12.0
    # Delay of NIXL's progress thread between polls, microseconds. vLLM's NIXL agent polls
    # with no delay and spins a core while idle; with a delay the thread sleeps in epoll and
    # still wakes at once for incoming traffic. 0 keeps vLLM's behaviour.
    nixl_progress_delay_us: int = 100_000
    # Salt of the block digest chain (the engine's KV compatibility hash). When given it must
    # match the hash the connector computes from the engine's config (a mismatch fails start).
    kv_compatibility_hash: str = ""
    # Post each KV pull (D->P and P->D) as the fewest, largest NIXL descriptors its block ids
    # and the KV layout allow, instead of vLLM's one per region x block, and sort the fresh blocks a
    # request receives by id so they form ascending runs (docs/coalesced-pulls.md). False keeps vLLM's
    # own block order and descriptors (for comparison).
    coalesce_pulls: bool = True
    # Pull-time fencing (docs/connector.md#pull-time-fencing): every block carries a generation, bumped
    # when a retained block goes back to vLLM's pool; retentions publish their blocks' generations, and
    # a prefill reads them again from the holder after each pull of a retention, recomputing on any
    # difference. Needs the engine core and its workers on one host. False: no generations published,
    # pulls not checked.
    fence_pulls: bool = True
    # How long, microseconds, a worker waits for a pull's generation read right after the data arrived
    # before it checks again at its next poll (a few microseconds on one host, tens over a network).
    fence_wait_us: int = 2000
    # The host tier (kvferry.connector.host_tier): slots of host memory, one KV block each, where a decode
    # engine moves retentions out of its KV cache (0: no host tier). Needs fence_pulls.
    host_pool_blocks: int = 0
    # A retention still held this long after its turn finished moves to the host pool (with a pool). One
    # pushed out of the KV cache's budget (retained_kv_fraction) moves at once while the pool has room.
    demote_after_seconds: float = 60.0
    # With a pool: while fewer than this fraction of the KV cache's blocks are free, least recently used
    # retentions move to the pool until enough would be (0: no watermark; the budget still applies).
    demote_below_free_fraction: float = 0.0
    # With a pool: a step that runs requests copies at most this many blocks into the pool (the copy runs
    # before the step's forward pass, so a long one would stall that step's decodes); an idle step copies
    # every waiting move.
    demote_blocks_per_step: int = 32
    # A prefill engine maps the host pool of a holder on the same host and copies pulled slots from it
    # itself (memmove, or its GPU's copy engine) instead of reading them over NIXL, which moves another
    # process's host memory into a GPU at ~0.8 GB/s on one host. False: NIXL READs only (a GPU holder's
    # pool then cannot be read).
    map_host_pools: bool = True

    def validate(self) -> None:
        problems: list[str] = []
        if self.max_retention_seconds <= 0:
            problems.append("max_retention_seconds must be > 0")
        if not self.release_grace_seconds > 0:
            problems.append(
                "release_grace_seconds must be > 0: it is what lets a prefill that was handed a retention "
                "just before it ended still read it (routers hand out read windows of at most half of it)"
            )
        if self.lease_ttl_seconds <= 0:
            problems.append("lease_ttl_seconds must be > 0")
        if not 0.0 < self.retained_kv_fraction <= 1.0:
            problems.append("retained_kv_fraction must be in (0, 1]")
        if self.min_read_seconds < 0:
            problems.append("min_read_seconds must be >= 0")
        if self.min_read_seconds >= max_read_window(self.release_grace_seconds) > 0:
            problems.append(
                "min_read_seconds must be smaller than half of release_grace_seconds (the longest read "
                "window a router hands out): no pull could start otherwise"
            )
        if self.stats_interval_seconds <= 0:
            problems.append("stats_interval_seconds must be > 0")
        if self.sidecar_timeout_seconds <= 0:
            problems.append("sidecar_timeout_seconds must be > 0")
        if self.nixl_progress_delay_us < 0:
            problems.append("nixl_progress_delay_us must be >= 0")
        if self.fence_wait_us < 0:
            problems.append("fence_wait_us must be >= 0")
        if self.host_pool_blocks < 0:
            problems.append("host_pool_blocks must be >= 0")
        if self.host_pool_blocks and not self.fence_pulls:
            problems.append(
                "host_pool_blocks needs fence_pulls: pulls of either tier are checked against the blocks' "
                "generations (the host tier's slots are reused too)"
            )
        if self.demote_after_seconds < 0:
            problems.append("demote_after_seconds must be >= 0")
        if self.demote_blocks_per_step < 1:
            problems.append("demote_blocks_per_step must be >= 1")
        if not 0.0 <= self.demote_below_free_fraction < 1.0:
            problems.append("demote_below_free_fraction must be in [0, 1)")
        if problems:
            raise SettingsError("invalid kvferry connector settings: " + "; ".join(problems))


# The kvferry keys live under this prefix-free sub-object of kv_connector_extra_config.
SETTINGS_KEY = "kvferry"


def parse_settings(extra_config: Mapping[str, Any] | None) -> KvferrySettings:
    """Settings from ``kv_connector_extra_config`` (kvferry's keys under ``"kvferry"``).

    Unknown kvferry keys and values of the wrong type raise :class:`SettingsError`, so a typo
    fails at engine start instead of silently using a default.
    """
    extra = dict(extra_config or {})
    if not extra.get("bidirectional_kv_xfer"):
        raise SettingsError(
            "kvferry needs bidirectional KV transfer: set kv_connector_extra_config"
            '["bidirectional_kv_xfer"] = true'
        )
    raw = extra.get(SETTINGS_KEY, {})
    if not isinstance(raw, Mapping):
        raise SettingsError(f'kv_connector_extra_config["{SETTINGS_KEY}"] must be an object, got {raw!r}')
    known = {f.name: f for f in fields(KvferrySettings)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SettingsError(
            f"unknown kvferry setting(s) {unknown}; known: {sorted(known)} (see docs/connector.md)"
        )
    values: dict[str, Any] = {}
    defaults = KvferrySettings()
    for name, value in raw.items():
        default = getattr(defaults, name)
        values[name] = _coerce(name, value, type(default))
    settings = KvferrySettings(**values)
    settings.validate()
    return settings


def _coerce(name: str, value: Any, kind: type) -> Any:
    if kind is bool or isinstance(value, bool):
        if kind is not bool or not isinstance(value, bool):
            raise SettingsError(f"kvferry setting {name} must be a {kind.__name__}, got {value!r}")
        return value
    if kind is float and isinstance(value, int | float):
        return float(value)
    if kind is int and isinstance(value, int):
        return value
    if kind is str and isinstance(value, str):
        return value
    raise SettingsError(f"kvferry setting {name} must be a {kind.__name__}, got {value!r}")


def settings_to_extra_config(settings: KvferrySettings) -> dict[str, Any]:
    """The ``"kvferry"`` object for ``kv_connector_extra_config`` (non-default values only)."""
    defaults = KvferrySettings()
    return {
        f.name: getattr(settings, f.name)
        for f in fields(KvferrySettings)
        if getattr(settings, f.name) != getattr(defaults, f.name)
    }
