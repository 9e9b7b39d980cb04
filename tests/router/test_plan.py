"""plan_turn, table by table: the proven prefix, pull or recompute, the engines. Pure: no servers."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace

import pytest
from kvferry.pd.digest import block_digests
from kvferry.pd.reuse import ReadWindow
from kvferry.router.calibration import CostProfile
from kvferry.router.cost import CostSettings, Reuse
from kvferry.router.engines import EngineInfo, EngineStats, EngineTable, LoadTracker
from kvferry.router.plan import PlanSettings, TurnPlan, hash_ahead, plan_turn
from kvferry.router.prefix import PromptDigests
from kvferry.router.registry_client import RetentionRecord
from kvferry.runtime.errors import ErrorKind, ServiceError
from kvferry.v1 import resources_pb2

BS = 16
SALT = "kv-a"
NOW = 1_000.0
HISTORY = list(range(100, 260))  # 160 tokens: 10 full blocks
PROMPT = [*HISTORY, 1, 2, 3]
# 1 ms per token to recompute; pulls cost 20 ms + 10 kB per token at 1 GB/s: pulling 64+ tokens wins.
PROFILE = CostProfile(
    prefill_tokens_per_second=1000.0, transfer_bytes_per_second=1e9, transfer_setup_seconds=0.02
)
READ_WINDOW_SECONDS = 10.0
SETTINGS = PlanSettings(
    CostSettings(
        PROFILE, kv_recompute_threshold=64, lease_margin_seconds=2.0, fallback_kv_bytes_per_token=10_000
    ),
    read_window_seconds=READ_WINDOW_SECONDS,
)
P, D, BOTH = (
    resources_pb2.ENGINE_ROLE_PREFILL,
    resources_pb2.ENGINE_ROLE_DECODE,
    resources_pb2.ENGINE_ROLE_BOTH,
)


def engine(
    engine_id: str, role: int, *, model: str = "m", kv_hash: str = SALT, grace: float = 30.0
) -> EngineInfo:
    return EngineInfo(
        engine_id,
        role,
        f"http://{engine_id}",
        "10.0.0.1",
        5600,
        model,
        kv_hash,
        BS,
        4096,
        release_grace_seconds=grace,
    )


def retention(
    *, engine_id: str = "d1", history: list[int] = HISTORY, expires_in: float = 60.0
) -> RetentionRecord:
    blocks = len(history) // BS
    return RetentionRecord(
        tenant="t",
        conversation_id="c",
        engine_id=engine_id,
        engine_request_id="cmpl-r-0",
        block_ids=tuple(range(40, 40 + blocks)),
        num_tokens=len(history),
        block_digests=tuple(block_digests(history, BS, salt=SALT)),
        turn=3,
        expire_time=NOW + expires_in,
    )


def window_of(record: RetentionRecord | None, read_window: float = READ_WINDOW_SECONDS) -> ReadWindow | None:
    """The read window of ``record`` looked up at NOW (monotonic and wall clocks both at NOW here)."""
    return None if record is None else ReadWindow.opened(NOW, read_window, record.expire_time - NOW)


@dataclass
class Case:
    name: str
    engines: list[EngineInfo]
    retention: RetentionRecord | None
    reuse: Reuse
    reason: str
    prefill: str
    decode: str
    matched: int = 0
    pulled: int = 0
    prompt: list[int] = field(default_factory=lambda: PROMPT)
    exclude: frozenset[str] = frozenset()
    prefill_load: dict[str, int] = field(default_factory=dict)


TWO_BY_TWO = [engine("p1", P), engine("p2", P), engine("d1", D), engine("d2", D)]

CASES = [
    Case("nothing retained", TWO_BY_TWO, None, Reuse.NONE, "nothing retained", "p1", "d1"),
    Case(
        "a matching retention is pulled, decoded on its holder",
        TWO_BY_TWO,
        retention(engine_id="d2"),
        Reuse.PULL,
        "beats recompute",
        "p1",
        "d2",
        matched=160,
        pulled=160,
    ),
    Case(
        "the holder left",
        TWO_BY_TWO,
        retention(engine_id="d9"),
        Reuse.NONE,
        "d9 holding the retention is gone",
        "p1",
        "d1",
    ),
    Case(
        "the holder serves another model",
        [*TWO_BY_TWO, engine("d3", D, model="other")],
        retention(engine_id="d3"),
        Reuse.NONE,
        "gone",
        "p1",
        "d1",
    ),
    Case(
        "an edited first block matches nothing",
        TWO_BY_TWO,
        retention(),
        Reuse.NONE,
        "no retained block matches",
        "p1",
        "d1",
        prompt=[7, *PROMPT[1:]],
    ),
    Case(
        "an edit in block 5 keeps blocks 0-4",
        TWO_BY_TWO,
        retention(),
        Reuse.PULL,
        "beats recompute",
        "p1",
        "d1",
        matched=80,
        pulled=80,
        prompt=[*PROMPT[:85], 7, *PROMPT[86:]],
    ),
    Case(
        "below the recompute threshold",
        TWO_BY_TWO,
        retention(),
        Reuse.RECOMPUTE,
        "kv_recompute_threshold",
        "p1",
        "d1",
        matched=48,
        prompt=[*PROMPT[:50], 7, *PROMPT[51:]],
    ),
    Case(
        "the lease ends too soon for the pull",
        TWO_BY_TWO,
        retention(expires_in=1.0),
        Reuse.RECOMPUTE,
        "lease ends in 1.00 s",
        "p1",
        "d1",
        matched=160,
    ),
    Case(
        "the holder's release grace is too short for the read window",
        [engine("p1", P), engine("d1", D, grace=19.0)],
        retention(),
        Reuse.RECOMPUTE,
        "engine d1's release grace (19 s) allows read windows of 9.5 s, not the router's 10 s",
        "p1",
        "d1",
        matched=160,
    ),
    Case(
        "the holder has not published its release grace",
        [engine("p1", P), engine("d1", D, grace=0.0)],
        retention(),
        Reuse.RECOMPUTE,
        "has not published its release grace",
        "p1",
        "d1",
        matched=160,
    ),
    Case(
        "a grace of twice the read window is enough",
        [engine("p1", P), engine("d1", D, grace=20.0)],
        retention(),
        Reuse.PULL,
        "",
        "p1",
        "d1",
        matched=160,
        pulled=160,
    ),
    Case(
        "no prefill engine reads the holder's KV layout",
        [engine("p1", P, kv_hash="kv-b"), engine("d1", D)],
        retention(),
        Reuse.RECOMPUTE,
        "no prefill engine can read",
        "p1",
        "d1",
        matched=160,
    ),
    Case(
        "the compatible prefill engine is taken even when busier",
        [engine("p1", P, kv_hash="kv-b"), engine("p2", P), engine("d1", D)],
        retention(),
        Reuse.PULL,
        "beats recompute",
        "p2",
        "d1",
        matched=160,
        pulled=160,
        prefill_load={"p2": 5000},
    ),
    Case(
        "least-loaded prefill",
        TWO_BY_TWO,
        None,
        Reuse.NONE,
        "nothing retained",
        "p2",
        "d1",
        prefill_load={"p1": 100},
    ),
    Case(
        "failed engines are avoided, the holder too",
        TWO_BY_TWO,
        None,
        Reuse.NONE,
        "nothing retained",
        "p2",
        "d2",
        exclude=frozenset({"p1", "d1"}),
    ),
    Case(
        "a failed engine serves when no other can",
        [engine("p1", P), engine("b1", BOTH)],
        None,
        Reuse.NONE,
        "nothing retained",
        "b1",
        "b1",
        exclude=frozenset({"p1", "b1"}),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_turn(case: Case) -> None:
    load = LoadTracker()
    for engine_id, tokens in case.prefill_load.items():
        load.add_prefill(engine_id, tokens)
    plan = plan_turn(
        case.prompt,
        case.retention,
        model="m",
        engines=EngineTable(case.engines),
        load=load,
        settings=SETTINGS,
        window=window_of(case.retention),
        now=NOW,
        exclude=case.exclude,
    )
    assert (plan.choice.reuse, plan.prefill.engine_id, plan.decode.engine_id) == (
        case.reuse,
        case.prefill,
        case.decode,
    )
    assert case.reason in plan.choice.reason
    assert plan.match.tokens == case.matched
    assert plan.choice.pull_tokens == case.pulled
    assert (plan.pull is not None) == (case.reuse is Reuse.PULL)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_plan_from_digests_hashed_ahead_is_the_same_plan(case: Case) -> None:
    """The turn hashes the prompt while its mark is in flight (for the record its lookup found); the plan
    then takes those digests and decides exactly as if it had hashed them itself."""
    engines = EngineTable(case.engines)

    def plan(hashed: PromptDigests | None) -> TurnPlan:
        return plan_turn(
            case.prompt,
            case.retention,
            model="m",
            engines=engines,
            load=LoadTracker(),
            settings=SETTINGS,
            window=window_of(case.retention),
            now=NOW,
            exclude=case.exclude,
            hashed=hashed,
        )

    assert plan(hash_ahead(case.prompt, case.retention, model="m", engines=engines)) == plan(None)


def test_digests_hashed_ahead_for_one_record_serve_another_only_as_far_as_they_fit() -> None:
    engines = EngineTable([engine("p1", P), engine("d1", D)])
    short = retention(history=HISTORY[:32])
    ahead = hash_ahead(PROMPT, short, model="m", engines=engines)
    assert ahead is not None and len(ahead.digests) == 2
    longer = retention()
    # Digests of another salt (another holder's KV layout) are never taken for this one's.
    wrong = PromptDigests("other-salt", BS, block_digests(PROMPT[: len(HISTORY)], BS, salt="other-salt"))
    # A longer record (the mark found a newer turn): the two digests do not reach; the plan hashes again.
    for hashed in (ahead, wrong):
        plan = plan_turn(
            PROMPT,
            longer,
            model="m",
            engines=engines,
            load=LoadTracker(),
            settings=SETTINGS,
            window=window_of(longer),
            now=NOW,
            hashed=hashed,
        )
        assert plan.match.tokens == len(HISTORY) // BS * BS
    assert hash_ahead(PROMPT, None, model="m", engines=engines) is None


def test_a_pull_names_exactly_the_holder_s_blocks_of_the_prefix() -> None:
    holder = engine("d1", D)
    plan = plan_turn(
        [*PROMPT[:85], 7, *PROMPT[86:]],
        retention(),
        model="m",
        engines=EngineTable([engine("p1", P), holder]),
        load=LoadTracker(),
        settings=SETTINGS,
        window=ReadWindow(NOW + 7.0),
        now=NOW,
    )
    assert plan.pull is not None and plan.pull.window == ReadWindow(NOW + 7.0)
    blocks = plan.pull.blocks
    assert blocks.block_ids == ((40, 41, 42, 43, 44),) and blocks.num_tokens == 80
    assert (blocks.engine_id, blocks.request_id, blocks.host, blocks.port) == (
        "d1",
        "cmpl-r-0",
        "10.0.0.1",
        5600,
    )


def test_a_pull_carries_the_generations_the_record_published_for_its_blocks() -> None:
    record = dataclasses.replace(retention(), block_generations=tuple(range(900, 900 + len(HISTORY) // BS)))
    plan = plan_turn(
        [*PROMPT[:85], 7, *PROMPT[86:]],
        record,
        model="m",
        engines=EngineTable([engine("p1", P), engine("d1", D)]),
        load=LoadTracker(),
        settings=SETTINGS,
        window=window_of(record),
        now=NOW,
    )
    assert plan.pull is not None and plan.pull.generations is not None
    # P checks them after pulling; one per pulled block, in the same order.
    assert plan.pull.generations.values == (900, 901, 902, 903, 904)
    unfenced = plan_turn(
        [*PROMPT[:85], 7, *PROMPT[86:]],
        retention(),
        model="m",
        engines=EngineTable([engine("p1", P), engine("d1", D)]),
        load=LoadTracker(),
        settings=SETTINGS,
        window=window_of(retention()),
        now=NOW,
    )
    assert unfenced.pull is not None and unfenced.pull.generations is None


def test_the_time_counted_on_is_what_the_read_window_has_left() -> None:
    # An hour of lease, but the prefill must start reading within the read window: 1.5 s is too short.
    record = retention(expires_in=3600.0)
    plan = _plan_with(record, window=window_of(record, read_window=1.5))
    assert plan.choice.reuse is Reuse.RECOMPUTE and "lease ends in 1.50 s" in plan.choice.reason
    assert _plan_with(record).choice.reuse is Reuse.PULL
    # A window opened 9 s ago (a slow tokenization since the lookup) has 1 s left.
    late = _plan_with(record, window=ReadWindow.opened(NOW - 9.0, READ_WINDOW_SECONDS, 3600.0))
    assert late.choice.reuse is Reuse.RECOMPUTE and "lease ends in 1.00 s" in late.choice.reason


def test_fragmented_retained_blocks_price_more_descriptors() -> None:
    profile = CostProfile(
        prefill_tokens_per_second=1000.0,
        transfer_bytes_per_second=1e9,
        transfer_setup_seconds=0.02,
        transfer_seconds_per_descriptor=0.01,
        descriptors_per_block=10,
        block_size_tokens=BS,
    )
    settings = PlanSettings(CostSettings(profile, fallback_kv_bytes_per_token=10_000), READ_WINDOW_SECONDS)
    ordered = _plan_with(retention(), settings=settings)
    scattered = _plan_with(replace(retention(), block_ids=tuple(range(100, 0, -10))), settings=settings)
    assert ordered.choice.reuse is Reuse.PULL and scattered.choice.reuse is Reuse.RECOMPUTE
    assert scattered.choice.estimated_pull_seconds > ordered.choice.estimated_pull_seconds


@pytest.mark.parametrize(
    ("engines", "missing"),
    [
        ([engine("d1", D)], "prefill"),
        ([engine("p1", P)], "decode"),
        ([engine("p1", P, model="x")], "prefill"),
    ],
)
def test_no_engine_for_a_role_is_unavailable(engines: list[EngineInfo], missing: str) -> None:
    with pytest.raises(ServiceError, match=f"no {missing} engine serves model 'm'") as raised:
        _plan_with(None, engines=engines)
    assert raised.value.kind is ErrorKind.UNAVAILABLE


def _plan_with(
    record: RetentionRecord | None,
    *,
    engines: list[EngineInfo] | None = None,
    settings: PlanSettings = SETTINGS,
    window: ReadWindow | None = None,
) -> TurnPlan:
    return plan_turn(
        PROMPT,
        record,
        model="m",
        engines=EngineTable(engines if engines is not None else TWO_BY_TWO),
        load=LoadTracker(),
        settings=settings,
        window=window if window is not None else window_of(record),
        now=NOW,
    )


def test_engine_rates_measured_by_the_prefill_engine_win() -> None:
    slow = EngineInfo(
        "p1", P, "http://p1", "h", 1, "m", SALT, BS, 4096, EngineStats(peer_pull_rates={"d1": 1e7})
    )
    plan = _plan_with(retention(), engines=[slow, engine("d1", D)])
    assert plan.choice.reuse is Reuse.RECOMPUTE and "cheaper" in plan.choice.reason
    assert "pull rate: measured" in plan.choice.reason
    assert math.isfinite(plan.choice.estimated_pull_seconds)


def test_a_rate_measured_from_another_peer_does_not_price_this_holder() -> None:
    # p1 pulls slowly from d2 (say, the same GPU); d1 is another pair: the profile still prices it.
    measured = EngineInfo(
        "p1", P, "http://p1", "h", 1, "m", SALT, BS, 4096, EngineStats(peer_pull_rates={"d2": 1e7})
    )
    plan = _plan_with(retention(), engines=[measured, engine("d1", D), engine("d2", D)])
    assert plan.choice.reuse is Reuse.PULL and "pull rate: profile" in plan.choice.reason


def _stats_proto(**peer_rates: float) -> resources_pb2.EngineStats:
    return resources_pb2.EngineStats(
        kv_bytes_per_token=10_000,
        peer_pull_rates=[
            resources_pb2.PeerPullRate(peer_engine_id=peer, bytes_per_second=rate, pulls=1)
            for peer, rate in peer_rates.items()
        ],
    )


def _registered(
    engine_id: str, role: resources_pb2.EngineRole.ValueType, stats: resources_pb2.EngineStats
) -> EngineInfo:
    return EngineInfo.from_proto(
        resources_pb2.Engine(
            engine_id=engine_id,
            role=role,
            http_endpoint=f"http://{engine_id}",
            nixl_host="10.0.0.1",
            nixl_port=5600,
            model="m",
            kv_compatibility_hash=SALT,
            block_size=BS,
            max_model_len=4096,
            stats=stats,
            release_grace_seconds=30.0,
        )
    )


def test_the_choice_flips_to_recompute_once_a_slow_pull_was_measured() -> None:
    """The profile promises fast pulls; the pair really pulls at 5 MB/s. The first reuse pulls (the
    one slow turn a wrong profile costs); the prefill engine's report of that pull, as the registry's
    watch delivers it, turns the next turn of the same size into a recompute; a transport that got
    fast again turns it back."""
    table = EngineTable([_registered("p1", P, _stats_proto()), _registered("d1", D, _stats_proto())])

    def choose() -> Reuse:
        return plan_turn(
            PROMPT,
            retention(),
            model="m",
            engines=table,
            load=LoadTracker(),
            settings=SETTINGS,
            window=window_of(retention()),
            now=NOW,
        ).choice.reuse

    assert choose() is Reuse.PULL
    # 160 tokens x 10 kB at 5 MB/s: 0.32 s, where recomputing them takes 0.16 s at the profile's rate.
    table.upsert(_registered("p1", P, _stats_proto(d1=5e6)))
    assert choose() is Reuse.RECOMPUTE
    table.upsert(_registered("p1", P, _stats_proto(d1=1e10)))
    assert choose() is Reuse.PULL


def test_a_retention_in_the_host_pool_is_priced_at_the_host_pools_measured_rate() -> None:
    """A holder's KV cache and its host pool are pulled at rates of their own (issue 19): a fast KV-cache
    rate does not price a pull from host memory, nor a slow host-pool rate a KV-cache pull. The pull of a
    host-pool retention tells P the tier (it times the pull apart)."""
    fast_kv_cache = resources_pb2.PeerPullRate(peer_engine_id="d1", bytes_per_second=1e10, pulls=4)
    slow_host_pool = resources_pb2.PeerPullRate(
        peer_engine_id="d1", bytes_per_second=5e6, pulls=4, tier=resources_pb2.MEMORY_TIER_HOST
    )
    stats = resources_pb2.EngineStats(
        kv_bytes_per_token=10_000, peer_pull_rates=[fast_kv_cache, slow_host_pool]
    )
    prefill = _registered("p1", P, stats)
    assert prefill.stats.pull_rate("d1", resources_pb2.MEMORY_TIER_HOST) == 5e6
    assert prefill.stats.pull_rate("d1", resources_pb2.MEMORY_TIER_DEVICE) == 1e10
    assert prefill.stats.pull_rate("d1", resources_pb2.MEMORY_TIER_UNSPECIFIED) == 1e10
    engines = [prefill, _registered("d1", D, _stats_proto())]
    in_kv_cache = _plan_with(retention(), engines=engines)
    assert in_kv_cache.choice.reuse is Reuse.PULL and "pull rate: measured" in in_kv_cache.choice.reason
    assert in_kv_cache.pull is not None and in_kv_cache.pull.tier == "device"
    # 160 tokens x 10 kB at 5 MB/s: 0.32 s against 0.16 s of recompute.
    in_host_pool = replace(retention(), tier=resources_pb2.MEMORY_TIER_HOST)
    assert _plan_with(in_host_pool, engines=engines).choice.reuse is Reuse.RECOMPUTE
    # Once the host pool pulls fast, the pull is planned with its tier.
    fast_host_pool = resources_pb2.PeerPullRate()
    fast_host_pool.CopyFrom(slow_host_pool)
    fast_host_pool.bytes_per_second = 1e9
    stats.ClearField("peer_pull_rates")
    stats.peer_pull_rates.extend([fast_kv_cache, fast_host_pool])
    engines[0] = _registered("p1", P, stats)
    planned = _plan_with(in_host_pool, engines=engines)
    assert planned.choice.reuse is Reuse.PULL and planned.pull is not None and planned.pull.tier == "host"
