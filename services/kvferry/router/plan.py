"""A turn's plan: which prefix the retention proves, pull or recompute, and which engines. Pure.

:func:`plan_turn` takes what the router knows at the moment (the prompt, the conversation's retention, the
engine table and the load this router has in flight) and decides in three steps:

1. **Prove the prefix** (docs/design.md rule 2): the retention counts only while its engine is registered and
   serves the model (rule 3); the prompt's digest chain, salted with the holder's KV compatibility hash, gives
   the longest block-aligned prefix the retention holds.
2. **Choose** pull or recompute: a holder whose release grace the read window is safely under
   (:func:`kvferry.pd.reuse.read_window_fits`; a grace it has not published counts as none), a prefill
   engine that can read the holder's KV layout, then the cost model
   (:func:`kvferry.router.cost.choose_reuse`) over its measured rates (its prefill rate, and the pull rate
   it measured reading from the holder) and the time left of the retention's read window (opened at its
   lookup, never past its lease).
3. **Pick engines**: prefill by load (the compatible one when a prefix matched), decode by affinity to the
   holder, else by load. Engines in ``exclude`` (failed this turn) are used only when no other can serve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvferry.pd.block_runs import mean_run_blocks
from kvferry.pd.digest import block_digests
from kvferry.pd.reuse import ReadWindow, RetainedKv, max_read_window, read_window_fits
from kvferry.pd.sequence import Pull
from kvferry.router.cost import CostSettings, RateInputs, Reuse, ReuseChoice, choose_reuse
from kvferry.router.engines import (
    EngineInfo,
    EngineTable,
    LoadTracker,
    pick_decode_engine,
    pick_prefill_engine,
)
from kvferry.router.prefix import (
    NO_MATCH,
    PrefixMatch,
    PromptDigestCache,
    PromptDigests,
    comparable_blocks,
    match_retained_prefix,
)
from kvferry.router.registry_client import RetentionRecord
from kvferry.runtime.errors import Unavailable


@dataclass(frozen=True)
class PlanSettings:
    cost: CostSettings
    # The read window handed out with a retention (its time left is the window's; this is its length,
    # which must be safely under the holder's release grace).
    read_window_seconds: float


@dataclass(frozen=True)
class TurnPlan:
    prefill: EngineInfo
    decode: EngineInfo
    # The engine holding the conversation's retention (None: none, or gone).
    holder: EngineInfo | None
    match: PrefixMatch
    choice: ReuseChoice
    # What P pulls (only when the choice is to pull).
    pull: Pull | None = None


def plan_turn(
    token_ids: Sequence[int],
    retention: RetentionRecord | None,
    *,
    model: str,
    engines: EngineTable,
    load: LoadTracker,
    settings: PlanSettings,
    window: ReadWindow | None,
    now: float,
    exclude: frozenset[str] = frozenset(),
    hashed: PromptDigests | None = None,
) -> TurnPlan:
    """The plan of one attempt of a turn (module docs). ``retention`` None: recompute (nothing retained, or
    a retry). ``window``: the retention's read window (opened at its lookup); ``now``: the monotonic time it
    is measured on; ``hashed``: the prompt's digests if hashed ahead (``hash_ahead``). Raises ``Unavailable``
    when no engine of the model can take a role."""
    holder = _holder(engines, retention, model)
    match = _proven_prefix(token_ids, retention, holder, hashed)
    compatible = None
    if holder is not None and match.tokens:
        compatible = pick_prefill_engine(
            engines.prefill_engines(model),
            load,
            exclude=exclude,
            kv_compatibility_hash=holder.kv_compatibility_hash,
        )
    seconds_left = window.seconds_left(now) if window is not None else 0.0
    choice = _choose(retention, holder, match, compatible, settings, seconds_left)
    prefill_candidates = engines.prefill_engines(model)
    prefill = (
        compatible
        or pick_prefill_engine(prefill_candidates, load, exclude=exclude)
        or pick_prefill_engine(prefill_candidates, load)
    )
    if prefill is None:
        raise Unavailable(f"no prefill engine serves model {model!r} right now; retry shortly")
    decode_candidates = engines.decode_engines(model)
    holder_id = holder.engine_id if holder is not None else None
    decode = pick_decode_engine(
        decode_candidates, load, holder_id=holder_id, exclude=exclude
    ) or pick_decode_engine(decode_candidates, load)
    if decode is None:
        raise Unavailable(f"no decode engine serves model {model!r} right now; retry shortly")
    pull = None
    if choice.reuse is Reuse.PULL and holder is not None and retention is not None:
        retained = RetainedKv(
            engine_id=holder.engine_id,
            engine_request_id=retention.engine_request_id,
            block_ids=retention.block_ids,
            num_tokens=retention.num_tokens,
            nixl_host=holder.nixl_host,
            nixl_port=holder.nixl_port,
            block_size=holder.block_size,
            lease_expire_time=retention.expire_time,
            block_generations=retention.block_generations,
            tier=retention.tier,
        )
        pull = Pull(
            retained.prefix(choice.pull_tokens),
            window=window,
            # P checks them after pulling: blocks D freed meanwhile cost a recompute, not a wrong answer.
            generations=retained.prefix_generations(choice.pull_tokens),
            tier=retained.pull_tier,
        )
    return TurnPlan(prefill=prefill, decode=decode, holder=holder, match=match, choice=choice, pull=pull)


def _holder(engines: EngineTable, retention: RetentionRecord | None, model: str) -> EngineInfo | None:
    holder = engines.get(retention.engine_id) if retention is not None else None
    return holder if holder is not None and holder.model == model else None


def hash_ahead(
    token_ids: Sequence[int],
    retention: RetentionRecord | None,
    *,
    model: str,
    engines: EngineTable,
    cache: PromptDigestCache | None = None,
) -> PromptDigests | None:
    """The prompt's digests the plan's prefix check will need for ``retention`` (None: it needs none),
    hashed before the plan (while the turn waits for its mark, when it still does). ``cache``: what the
    conversation's last prompt hashed, to chain on from."""
    holder = _holder(engines, retention, model)
    if retention is None or holder is None:
        return None
    blocks = comparable_blocks(
        len(token_ids),
        retained_digests=retention.block_digests,
        retained_num_tokens=retention.num_tokens,
        retained_num_blocks=len(retention.block_ids),
        block_size=holder.block_size,
    )
    if not blocks:
        return None
    salt, block_size = holder.kv_compatibility_hash, holder.block_size
    prefix = token_ids[: blocks * block_size]
    digests = (
        block_digests(prefix, block_size, salt=salt)
        if cache is None
        else cache.digests(
            (retention.tenant, retention.conversation_id), prefix, block_size=block_size, salt=salt
        )
    )
    return PromptDigests(salt, block_size, digests)


def _proven_prefix(
    token_ids: Sequence[int],
    retention: RetentionRecord | None,
    holder: EngineInfo | None,
    hashed: PromptDigests | None,
) -> PrefixMatch:
    if retention is None or holder is None:
        return NO_MATCH
    return match_retained_prefix(
        token_ids,
        retained_digests=retention.block_digests,
        retained_num_tokens=retention.num_tokens,
        retained_num_blocks=len(retention.block_ids),
        block_size=holder.block_size,
        salt=holder.kv_compatibility_hash,
        hashed=hashed,
    )


def _choose(
    retention: RetentionRecord | None,
    holder: EngineInfo | None,
    match: PrefixMatch,
    prefill: EngineInfo | None,
    settings: PlanSettings,
    read_seconds_left: float,
) -> ReuseChoice:
    if retention is None:
        return ReuseChoice(Reuse.NONE, 0, "nothing retained for this conversation")
    if holder is None:
        return ReuseChoice(Reuse.NONE, 0, f"engine {retention.engine_id} holding the retention is gone")
    if not match.tokens:
        return ReuseChoice(Reuse.NONE, 0, "no retained block matches the prompt")
    if not read_window_fits(settings.read_window_seconds, holder.release_grace_seconds):
        return ReuseChoice(Reuse.RECOMPUTE, 0, _grace_too_short(holder, settings.read_window_seconds))
    if prefill is None:
        return ReuseChoice(Reuse.RECOMPUTE, 0, "no prefill engine can read the holder's KV layout")
    return choose_reuse(
        match.tokens,
        lease_seconds_left=read_seconds_left,
        rates=RateInputs(
            prefill_tokens_per_second=prefill.stats.prefill_tokens_per_second,
            pull_bytes_per_second=prefill.stats.pull_rate(holder.engine_id, retention.tier),
            kv_bytes_per_token=prefill.stats.kv_bytes_per_token or holder.stats.kv_bytes_per_token,
            run_blocks=mean_run_blocks(retention.block_ids[: match.blocks]),
        ),
        settings=settings.cost,
    )


def _grace_too_short(holder: EngineInfo, read_window_seconds: float) -> str:
    if holder.release_grace_seconds <= 0:
        return f"engine {holder.engine_id} holding the retention has not published its release grace"
    return (
        f"engine {holder.engine_id}'s release grace ({holder.release_grace_seconds:g} s) allows read windows "
        f"of {max_read_window(holder.release_grace_seconds):g} s, not the router's {read_window_seconds:g} s"
    )
