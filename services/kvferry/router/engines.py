"""The engine table the router keeps from the registry's watch, and engine selection.

Selection balances on load the router sees itself (requests it has in flight on each engine, exact and
current) plus what each engine last reported (which includes other routers' requests, but lags).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvferry.v1 import resources_pb2

_PREFILL_ROLES = (resources_pb2.ENGINE_ROLE_PREFILL, resources_pb2.ENGINE_ROLE_BOTH)
_DECODE_ROLES = (resources_pb2.ENGINE_ROLE_DECODE, resources_pb2.ENGINE_ROLE_BOTH)


@dataclass(frozen=True)
class EngineStats:
    prefill_tokens_per_second: float = 0.0
    transfer_bytes_per_second: float = 0.0
    kv_bytes_per_token: int = 0
    inflight_prefill_tokens: int = 0
    running_requests: int = 0
    # Pull throughput this engine measured reading from each peer engine's KV cache, bytes per second.
    peer_pull_rates: Mapping[str, float] = field(default_factory=dict)
    # The same from each peer's host pool (a tier of its own transport: host memory into the GPU).
    host_pool_pull_rates: Mapping[str, float] = field(default_factory=dict)

    def pull_rate(self, peer_engine_id: str, tier: int) -> float:
        """Bytes per second measured reading ``peer_engine_id``'s ``tier`` (a ``resources_pb2.MemoryTier``);
        0: not measured yet (the cost model's profile then stands in, until the first pull measures it)."""
        rates = self.host_pool_pull_rates if tier == resources_pb2.MEMORY_TIER_HOST else self.peer_pull_rates
        return rates.get(peer_engine_id, 0.0)


@dataclass(frozen=True)
class EngineInfo:
    """What the router needs to know about one registered engine."""

    engine_id: str
    role: int  # resources_pb2.EngineRole
    http_endpoint: str
    nixl_host: str
    nixl_port: int
    model: str
    kv_compatibility_hash: str
    block_size: int
    max_model_len: int
    stats: EngineStats = field(default_factory=EngineStats)
    # How long it keeps a retention's blocks after the registry ended it; 0: not known (nothing is
    # pulled from it).
    release_grace_seconds: float = 0.0

    @property
    def can_prefill(self) -> bool:
        return self.role in _PREFILL_ROLES

    @property
    def can_decode(self) -> bool:
        return self.role in _DECODE_ROLES

    @classmethod
    def from_proto(cls, engine: resources_pb2.Engine) -> EngineInfo:
        s = engine.stats
        return cls(
            engine_id=engine.engine_id,
            role=engine.role,
            http_endpoint=engine.http_endpoint.rstrip("/"),
            nixl_host=engine.nixl_host,
            nixl_port=engine.nixl_port,
            model=engine.model,
            kv_compatibility_hash=engine.kv_compatibility_hash,
            block_size=engine.block_size,
            max_model_len=engine.max_model_len,
            stats=EngineStats(
                prefill_tokens_per_second=s.prefill_tokens_per_second,
                transfer_bytes_per_second=s.transfer_bytes_per_second,
                kv_bytes_per_token=s.kv_bytes_per_token,
                inflight_prefill_tokens=s.inflight_prefill_tokens,
                running_requests=s.running_requests,
                peer_pull_rates={
                    p.peer_engine_id: p.bytes_per_second
                    for p in s.peer_pull_rates
                    if p.tier != resources_pb2.MEMORY_TIER_HOST
                },
                host_pool_pull_rates={
                    p.peer_engine_id: p.bytes_per_second
                    for p in s.peer_pull_rates
                    if p.tier == resources_pb2.MEMORY_TIER_HOST
                },
            ),
            release_grace_seconds=engine.release_grace_seconds,
        )


class EngineTable:
    """Live engines by id. Mutated only by the registry watcher; read by every turn."""

    def __init__(self, engines: Iterable[EngineInfo] = ()) -> None:
        self._engines: dict[str, EngineInfo] = {e.engine_id: e for e in engines}

    def __len__(self) -> int:
        return len(self._engines)

    def upsert(self, engine: EngineInfo) -> None:
        self._engines[engine.engine_id] = engine

    def remove(self, engine_id: str) -> EngineInfo | None:
        return self._engines.pop(engine_id, None)

    def replace_all(self, engines: Iterable[EngineInfo]) -> None:
        self._engines = {e.engine_id: e for e in engines}

    def get(self, engine_id: str) -> EngineInfo | None:
        return self._engines.get(engine_id)

    def all(self) -> list[EngineInfo]:
        return list(self._engines.values())

    def models(self) -> list[str]:
        return sorted({e.model for e in self._engines.values()})

    def prefill_engines(self, model: str) -> list[EngineInfo]:
        return [e for e in self._engines.values() if e.model == model and e.can_prefill]

    def decode_engines(self, model: str) -> list[EngineInfo]:
        return [e for e in self._engines.values() if e.model == model and e.can_decode]


@dataclass
class _InFlight:
    prefill_tokens: int = 0
    decode_requests: int = 0


class LoadTracker:
    """Work this router has in flight on each engine."""

    def __init__(self) -> None:
        self._by_engine: dict[str, _InFlight] = {}

    def _entry(self, engine_id: str) -> _InFlight:
        entry = self._by_engine.get(engine_id)
        if entry is None:
            entry = self._by_engine[engine_id] = _InFlight()
        return entry

    def prefill_tokens(self, engine_id: str) -> int:
        entry = self._by_engine.get(engine_id)
        return entry.prefill_tokens if entry else 0

    def decode_requests(self, engine_id: str) -> int:
        entry = self._by_engine.get(engine_id)
        return entry.decode_requests if entry else 0

    def add_prefill(self, engine_id: str, tokens: int) -> None:
        self._entry(engine_id).prefill_tokens += tokens

    def add_decode(self, engine_id: str, requests: int) -> None:
        self._entry(engine_id).decode_requests += requests

    def forget(self, engine_id: str) -> None:
        self._by_engine.pop(engine_id, None)


def pick_prefill_engine(
    candidates: Sequence[EngineInfo],
    load: LoadTracker,
    *,
    exclude: frozenset[str] = frozenset(),
    kv_compatibility_hash: str | None = None,
) -> EngineInfo | None:
    """The prefill engine with the fewest prompt tokens in flight (ties: lowest id, for stable tests).

    With ``kv_compatibility_hash`` set, only engines that can read that KV layout qualify.
    """
    usable = [
        e
        for e in candidates
        if e.engine_id not in exclude
        and (kv_compatibility_hash is None or e.kv_compatibility_hash == kv_compatibility_hash)
    ]
    if not usable:
        return None
    return min(
        usable,
        key=lambda e: (load.prefill_tokens(e.engine_id) + e.stats.inflight_prefill_tokens, e.engine_id),
    )


def pick_decode_engine(
    candidates: Sequence[EngineInfo],
    load: LoadTracker,
    *,
    holder_id: str | None = None,
    exclude: frozenset[str] = frozenset(),
) -> EngineInfo | None:
    """The engine holding the conversation when it is usable (affinity), else the least loaded."""
    usable = [e for e in candidates if e.engine_id not in exclude]
    if not usable:
        return None
    for engine in usable:
        if engine.engine_id == holder_id:
            return engine
    return min(
        usable,
        key=lambda e: (load.decode_requests(e.engine_id) + e.stats.running_requests, e.engine_id),
    )
