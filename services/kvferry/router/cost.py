"""Pull the retained prefix from the decode engine, or recompute it on the prefill engine?

Pulling costs a fixed setup plus the KV bytes over the link; recomputing costs the prefix's tokens at
the prefill engine's rate. Rates come from what the engines measured themselves (EngineStats) and
fall back to a :class:`~kvferry.router.calibration.CostProfile`.

Measured figures replace the profile's whole estimate, not one term of it: the prefill engine's
measured rate (compute only, attention included at the prompt lengths it saw) prices a recompute, and
the pull rate it measured reading from *this* holder (posting, transfer and completion included)
prices a pull. A profile calibrated on another machine can be wrong by orders of magnitude (two
processes on one GPU pull through UCX's host path at 0.5 GB/s where NVLink gives 300): the first pull
after NIXL's handshake with a holder measures the pair (the handshake pull itself is no sample), the
connector reports it at once, and the next turn follows the measurement.

Below ``kv_recompute_threshold`` tokens the engines themselves recompute, so the router does too; a
lease that may end before the pull finishes (plus a safety margin) also means recompute (rule 3 of
docs/design.md).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal

from kvferry.router.calibration import CostProfile, pull_seconds, recompute_seconds


class Reuse(enum.Enum):
    NONE = "none"  # nothing usable retained
    PULL = "pull"  # pull the retained prefix
    RECOMPUTE = "recompute"  # a prefix matched, but recomputing it is the better (or only safe) choice


@dataclass(frozen=True)
class CostSettings:
    profile: CostProfile
    # Fewest matched tokens worth a pull (the engines' own kv_recompute_threshold).
    kv_recompute_threshold: int = 64
    # Lease time that must remain after the estimated pull, seconds.
    lease_margin_seconds: float = 2.0
    # KV bytes per token when neither the engines nor the profile know it.
    fallback_kv_bytes_per_token: int = 0
    # "cost": pull when cheaper; "always": pull whenever the threshold and the lease allow (A/B runs,
    # tests); "never": always recompute.
    policy: Literal["cost", "always", "never"] = "cost"


@dataclass(frozen=True)
class RateInputs:
    """What the prefill engine that would pull or recompute measured (0: not measured yet)."""

    prefill_tokens_per_second: float
    # What the prefill engine measured pulling from the engine holding this retention, bytes per
    # second (0: never pulled from it: the profile's estimate). Another peer's rate says nothing
    # about this one.
    pull_bytes_per_second: float
    kv_bytes_per_token: int
    # Mean length of the runs of consecutive retained block ids (inf: one run); fragmented ids
    # make a pull post more NIXL descriptors (see docs/calibration.md).
    run_blocks: float = math.inf


@dataclass(frozen=True)
class ReuseChoice:
    reuse: Reuse
    # Tokens to pull (0 unless PULL).
    pull_tokens: int
    # Why, for logs and traces.
    reason: str
    estimated_pull_seconds: float = 0.0
    estimated_recompute_seconds: float = 0.0


def choose_reuse(
    matched_tokens: int, *, lease_seconds_left: float, rates: RateInputs, settings: CostSettings
) -> ReuseChoice:
    if matched_tokens <= 0:
        return ReuseChoice(Reuse.NONE, 0, "no retained block matches the prompt")
    if settings.policy == "never":
        return ReuseChoice(Reuse.RECOMPUTE, 0, "reuse policy is 'never'")
    if matched_tokens < settings.kv_recompute_threshold:
        return ReuseChoice(
            Reuse.RECOMPUTE,
            0,
            f"{matched_tokens} matched tokens < kv_recompute_threshold {settings.kv_recompute_threshold}",
        )
    # The calibrated profile (quadratic prefill, per-descriptor pull cost) until the engines measured
    # their own figures (module docs).
    profile = settings.profile
    bytes_per_token = (
        rates.kv_bytes_per_token or profile.kv_bytes_per_token or settings.fallback_kv_bytes_per_token
    )
    recompute_s = (
        matched_tokens / rates.prefill_tokens_per_second
        if rates.prefill_tokens_per_second
        else recompute_seconds(profile, matched_tokens)
    )
    if rates.pull_bytes_per_second and bytes_per_token:
        pull_s = matched_tokens * bytes_per_token / rates.pull_bytes_per_second
    elif bytes_per_token:
        pull_s = pull_seconds(profile, matched_tokens, bytes_per_token, run_blocks=max(1.0, rates.run_blocks))
    else:
        # Nobody reported the KV size yet (an engine's first seconds): count the fixed cost only.
        pull_s = profile.transfer_setup_seconds
    basis = _basis(rates)
    if lease_seconds_left < pull_s + settings.lease_margin_seconds:
        return ReuseChoice(
            Reuse.RECOMPUTE,
            0,
            f"lease ends in {lease_seconds_left:.2f} s, too soon for a {pull_s * 1000:.0f} ms pull",
            pull_s,
            recompute_s,
        )
    if pull_s >= recompute_s and settings.policy == "cost":
        return ReuseChoice(
            Reuse.RECOMPUTE,
            0,
            f"recompute ({recompute_s * 1000:.1f} ms) is cheaper than a pull ({pull_s * 1000:.1f} ms){basis}",
            pull_s,
            recompute_s,
        )
    return ReuseChoice(
        Reuse.PULL,
        matched_tokens,
        f"pull ({pull_s * 1000:.1f} ms) beats recompute ({recompute_s * 1000:.1f} ms){basis}"
        if settings.policy == "cost"
        else "reuse policy is 'always'",
        pull_s,
        recompute_s,
    )


def _basis(rates: RateInputs) -> str:
    """Which figures an estimate stands on, for the reason."""
    pull = "measured" if rates.pull_bytes_per_second else "profile"
    prefill = "measured" if rates.prefill_tokens_per_second else "profile"
    return f" (pull rate: {pull}, prefill rate: {prefill})"
