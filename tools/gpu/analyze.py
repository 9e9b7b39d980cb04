"""Tables, fits and the pull-vs-recompute crossover from the JSON that run_all.sh writes.

Usage: PYTHONPATH=services python tools/gpu/analyze.py OUT_DIR > analysis.md
Reads OUT_DIR/transfer.json, prefill.json and (if present) transfer_isolated.json; prints Markdown, ending
with the GPU_PROFILES entries for services/kvferry/router/calibration.py.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import numpy as np

# Run as a script from anywhere: the repository root makes tools.gpu importable, services/ kvferry.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(1, os.path.join(sys.path[0], "services"))
from kvferry.router.calibration import (
    CostProfile,
    crossover_tokens,
    prefill_seconds,
    pull_seconds,
    recompute_seconds,
    ttft_saving_seconds,
)

from tools.gpu.model_shapes import SHAPES

PULL_MODES = ("per_block", "coalesced")


def _load(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)  # type: ignore[no-any-return]


def weighted_fit(columns: list[np.ndarray], y: np.ndarray) -> np.ndarray:
    """Least squares on relative error (weights 1/y), so short and long runs count alike."""
    a = np.stack(columns, axis=1) / y[:, None]
    coef: np.ndarray = np.linalg.lstsq(a, np.ones_like(y), rcond=None)[0]
    return coef


def fit_prefill(n: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """seconds ~ fixed + n * per_token + n^2 * quad, each term non-negative."""
    fixed, per_token, quad = weighted_fit([np.ones_like(n), n, n * n], seconds)
    if quad < 0:
        fixed, per_token = weighted_fit([np.ones_like(n), n], seconds)
        quad = 0.0
    if fixed < 0:
        per_token, quad = weighted_fit([n, n * n], seconds)
        fixed = 0.0
    return float(fixed), float(per_token), float(quad)


def fit_transfer(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """seconds ~ setup + bytes / bandwidth; returns (setup, bandwidth)."""
    setup, per_byte = weighted_fit([np.ones_like(nbytes), nbytes], seconds)
    if setup < 0:
        (per_byte,) = weighted_fit([nbytes], seconds)
        setup = 0.0
    return float(setup), float(1.0 / per_byte)


def _records(data: dict[str, Any] | None, **match: Any) -> list[dict[str, Any]]:
    if data is None:
        return []
    return [r for r in data["records"] if all(r.get(k) == v for k, v in match.items())]


def _one(records: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    return found[0] if found else None


def _cell(record: dict[str, Any] | None, key: str, fmt: str) -> str:
    if record is None or record.get(key) is None:
        return "-"
    return format(record[key], fmt)


def per_descriptor_seconds(
    record: dict[str, Any], transfer_fits: dict[str, tuple[float, float]]
) -> float | None:
    """Cost of each descriptor a fragmented pull has beyond the contiguous pull's one per region."""
    fit = transfer_fits.get(record["shape"])
    merged = record.get("nixl_desc_count")
    regions = 2 * SHAPES[record["shape"]].num_layers
    if fit is None or merged is None or merged <= regions:
        return None
    setup, bandwidth = fit
    contiguous_s = setup + record["bytes"] / bandwidth
    return float((record["total_ms"] * 1e-3 - contiguous_s) / (merged - regions))


def transfer_tables(
    transfer: dict[str, Any],
    repeat: dict[str, Any] | None,
    transfer_fits: dict[str, tuple[float, float]],
    out: list[str],
) -> None:
    for shape in dict.fromkeys(r["shape"] for r in transfer["records"]):
        recs = _records(transfer, shape=shape, layout="contiguous")
        out.append(f"\n### {shape}: pull of contiguous blocks, GPU 0 -> GPU 1 (median ms, GB/s)\n")
        out.append(
            "| tokens | GB | per-block descs | per-block ms | GB/s | coalesced descs | coalesced ms | GB/s "
            "| torch per-region ms | GB/s | torch flat ms | GB/s | bytes verified | repeat run:"
            " per-block / coalesced ms |"
        )
        out.append("|" + " --- |" * 14)
        for tokens in sorted({r["tokens"] for r in recs}):
            pb = _one(recs, tokens=tokens, mode="per_block")
            co = _one(recs, tokens=tokens, mode="coalesced")
            tr = _one(recs, tokens=tokens, mode="torch_per_region")
            tf = _one(recs, tokens=tokens, mode="torch_flat")
            ok = all(r["verified"] for r in (pb, co, tr, tf) if r is not None)
            rep = _records(repeat, shape=shape, layout="contiguous", tokens=tokens)
            rpb, rco = _one(rep, mode="per_block"), _one(rep, mode="coalesced")
            gb = (pb or co or tr or tf or {"bytes": 0})["bytes"] / 1e9
            out.append(
                f"| {tokens:,} | {gb:.3f} | {_cell(pb, 'descriptors', ',')} | {_cell(pb, 'total_ms', '.2f')} "
                f"| {_cell(pb, 'gbps_total', '.1f')} | {_cell(co, 'descriptors', ',')} "
                f"| {_cell(co, 'total_ms', '.2f')} | {_cell(co, 'gbps_total', '.1f')} "
                f"| {_cell(tr, 'total_ms', '.2f')} | {_cell(tr, 'gbps_total', '.1f')} "
                f"| {_cell(tf, 'total_ms', '.2f')} | {_cell(tf, 'gbps_total', '.1f')} "
                f"| {'yes' if ok else 'NO'} "
                f"| {_cell(rpb, 'total_ms', '.2f')} / {_cell(rco, 'total_ms', '.2f')} |"
            )
        out.append(
            f"\n{shape}: where a NIXL pull's time goes (median ms: build descriptors / make request /"
            f" post / wait)\n"
        )
        out.append(
            "| tokens | mode | build | make | post | wait | NIXL descs after merging | first pull ms |"
        )
        out.append("|" + " --- |" * 8)
        for r in sorted((r for r in recs if r["mode"] in PULL_MODES), key=lambda r: (r["tokens"], r["mode"])):
            out.append(
                f"| {r['tokens']:,} | {r['mode']} | {r['build_ms']:.2f} | {r['make_ms']:.2f} |"
                f" {r['post_ms']:.2f} "
                f"| {r['wait_ms']:.2f} | {_cell(r, 'nixl_desc_count', ',')} "
                f"| {_cell(r, 'first_pull_ms', '.1f')} |"
            )
    frag = [r for r in transfer["records"] if r["layout"] != "contiguous"]
    if frag:
        out.append(
            "\n### Fragmented block ids: source ids in shuffled runs of N blocks (destination contiguous)\n\n"
            "NIXL merges descriptors whose addresses are adjacent on both sides, so what a pull"
            " costs depends on the "
            "descriptors left after merging (telemetry), not on how many were listed. Cost per descriptor: "
            "(ms - contiguous pull of the same bytes) / (descriptors after merging - regions).\n"
        )
        out.append(
            "| shape | tokens | run blocks | mode | descriptors listed | after merging | ms | GB/s |"
            " us per extra descriptor | verified |"
        )
        out.append("|" + " --- |" * 10)
        for r in frag:
            per_desc = per_descriptor_seconds(r, transfer_fits)
            out.append(
                f"| {r['shape']} | {r['tokens']:,} | {r['layout'].removeprefix('runs')} | {r['mode']}"
                f" | {r['descriptors']:,} "
                f"| {_cell(r, 'nixl_desc_count', ',')} | {r['total_ms']:.2f} | {r['gbps_total']:.1f} "
                f"| {'-' if per_desc is None else format(per_desc * 1e6, '.2f')} "
                f"| {'yes' if r['verified'] else 'NO'} |"
            )
    out.append("\n### One-off setup per engine pair\n")
    out.append(
        "| shape | register KV (holder) s | add remote agent s | prep all block descriptors s |"
        " descriptors per side |"
    )
    out.append("|" + " --- |" * 5)
    for s in transfer["setup"]:
        out.append(
            f"| {s['shape']} | {s['register_holder_s']:.3f} | {s['add_remote_agent_s']:.3f} "
            f"| {s['prep_all_block_dlists_s']:.3f} | {s['prepped_descriptors_per_side']:,} |"
        )


def prefill_tables(
    prefill: dict[str, Any], fits: dict[str, tuple[float, float, float]], out: list[str]
) -> None:
    for s in prefill["setup"]:
        shape = s["shape"]
        out.append(
            f"\n### {shape}: prefill on one GPU ({s['layers_run']} of {s['layers_in_model']} layers"
            f" run; attention "
            f"{s['attention']['backend']}, native GQA {s['attention']['native_gqa']}; "
            f"suffix attention {s['attention'].get('suffix_method', '-')})\n"
        )
        out.append("| tokens | ms (median) | min-max | us/token | tokens/s | TFLOP/s | fit ms |")
        out.append("|" + " --- |" * 7)
        fixed, per_token, quad = fits[shape]
        for r in _records(prefill, shape=shape, kind="full"):
            n = r["new_tokens"]
            fit_ms = (fixed + per_token * n + quad * n * n) * 1e3
            out.append(
                f"| {n:,} | {r['total_ms']:.1f} | {r['total_ms_min']:.1f}-{r['total_ms_max']:.1f} "
                f"| {r['us_per_token']:.2f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {fit_ms:.1f} |"
            )
        out.append(
            f"\nFit: prefill(n) = {fixed * 1e3:.2f} ms + n x {per_token * 1e6:.3f} us "
            f"+ n^2 x {quad * 1e12:.4f} ps\n"
        )
        suffix = _records(prefill, shape=shape, kind="suffix")
        if suffix:
            out.append(
                "| cached tokens | new tokens | suffix prefill ms | model ms | full prefill of the"
                " total, ms |"
            )
            out.append("|" + " --- |" * 5)
            for r in suffix:
                k, new = r["prefix_tokens"], r["new_tokens"]
                model = (fixed + per_token * new + quad * ((k + new) ** 2 - k * k)) * 1e3
                full = _one(_records(prefill, shape=shape, kind="full"), new_tokens=k + new)
                out.append(
                    f"| {k:,} | {new:,} | {r['total_ms']:.1f} | {model:.1f} "
                    f"| {_cell(full, 'total_ms', '.1f')} |"
                )


def main() -> int:
    out_dir = sys.argv[1]
    transfer = _load(os.path.join(out_dir, "transfer.json"))
    prefill = _load(os.path.join(out_dir, "prefill.json"))
    isolated = _load(os.path.join(out_dir, "transfer_isolated.json"))
    out: list[str] = ["# H200 calibration: measured tables"]
    prefill_fits: dict[str, tuple[float, float, float]] = {}
    if prefill is not None:
        for s in prefill["setup"]:
            full = _records(prefill, shape=s["shape"], kind="full")
            n = np.array([r["new_tokens"] for r in full], dtype=float)
            t = np.array([r["total_ms"] for r in full], dtype=float) / 1e3
            prefill_fits[s["shape"]] = fit_prefill(n, t)
    repeat = _load(os.path.join(out_dir, "transfer_repeat.json"))
    transfer_fits: dict[str, tuple[float, float]] = {}
    descriptor_costs: dict[str, float] = {}
    if transfer is not None:
        for shape in dict.fromkeys(r["shape"] for r in transfer["records"]):
            # Both modes, this run and the repeat: with contiguous ids NIXL merges the per-block list into the
            # same request as the coalesced one, so they are samples of one cost.
            recs = [
                r
                for data in (transfer, repeat)
                for r in _records(data, shape=shape, layout="contiguous")
                if r["mode"] in PULL_MODES
            ]
            b = np.array([r["bytes"] for r in recs], dtype=float)
            t = np.array([r["total_ms"] for r in recs], dtype=float) / 1e3
            transfer_fits[shape] = fit_transfer(b, t)
        for shape in transfer_fits:
            costs = [
                c
                for r in _records(transfer, shape=shape)
                if r["layout"] != "contiguous" and (c := per_descriptor_seconds(r, transfer_fits)) is not None
            ]
            if costs:
                descriptor_costs[shape] = float(np.median(costs))
        out.append("\n## KV pull (NIXL READ, two processes) and torch copies")
        transfer_tables(transfer, repeat, transfer_fits, out)
        out.append("\nFit over both modes and both runs: pull(bytes) = setup + bytes / bandwidth\n")
        out.append(
            "| shape | setup ms | bandwidth GB/s | us per extra descriptor (median of fragmented pulls) |"
        )
        out.append("| --- | --- | --- | --- |")
        for shape, (setup, bw) in transfer_fits.items():
            out.append(
                f"| {shape} | {setup * 1e3:.2f} | {bw / 1e9:.1f} "
                f"| {descriptor_costs.get(shape, 0.0) * 1e6:.2f} |"
            )
    if isolated is not None:
        out.append("\n### Check: one GPU visible per process (CUDA_VISIBLE_DEVICES), as vLLM engines run\n")
        out.append("| shape | tokens | mode | ms | GB/s | verified |")
        out.append("|" + " --- |" * 6)
        for r in isolated["records"]:
            out.append(
                f"| {r['shape']} | {r['tokens']:,} | {r['mode']} | {r['total_ms']:.2f} |"
                f" {r['gbps_total']:.1f} "
                f"| {'yes' if r['verified'] else 'NO'} |"
            )
    if prefill is not None:
        out.append("\n## Prefill cost")
        prefill_tables(prefill, prefill_fits, out)

    profiles: dict[str, CostProfile] = {}
    for shape, (setup, bw) in transfer_fits.items():
        if shape not in prefill_fits:
            continue
        fixed, per_token, quad = prefill_fits[shape]
        profiles[shape] = CostProfile(
            prefill_tokens_per_second=1.0 / per_token,
            transfer_bytes_per_second=bw,
            transfer_setup_seconds=setup,
            kv_bytes_per_token=SHAPES[shape].kv_bytes_per_token,
            prefill_seconds_per_token_squared=quad,
            prefill_fixed_seconds=fixed,
            transfer_seconds_per_descriptor=descriptor_costs.get(shape, 0.0),
            descriptors_per_block=2 * SHAPES[shape].num_layers,
        )
    if profiles:
        runs = (math.inf, 64, 16, 8, 4, 2, 1)
        out.append("\n## Crossover: fewest reusable tokens at which pulling beats recomputing\n")
        out.append(
            "By the mean run of consecutive block ids the two engines' blocks form (inf: fully contiguous).\n"
        )
        out.append("| shape | " + " | ".join(f"runs of {r}" for r in runs) + " |")
        out.append("|" + " --- |" * (len(runs) + 1))
        for shape, p in profiles.items():
            cells = []
            for r in runs:
                k = crossover_tokens(p, run_blocks=r)
                cells.append("never" if math.isinf(k) else f"{k:,.0f}")
            out.append(f"| {shape} | " + " | ".join(cells) + " |")
        out.append(
            "\n| shape | tokens | pull ms (contiguous) | pull ms (runs of 8) | pull ms (runs of 1) |"
            " recompute ms |"
        )
        out.append("|" + " --- |" * 6)
        for shape, p in profiles.items():
            for k in (64, 256, 1024, 4096, 16384, 32768):
                out.append(
                    f"| {shape} | {k:,} | {pull_seconds(p, k) * 1e3:.2f} "
                    f"| {pull_seconds(p, k, run_blocks=8) * 1e3:.2f} "
                    f"| {pull_seconds(p, k, run_blocks=1) * 1e3:.2f} | {recompute_seconds(p, k) * 1e3:.2f} |"
                )
        assert prefill is not None
        out.append("\n## Expected TTFT with 2,048 new tokens per turn\n")
        out.append(
            "Recompute: full prefill measured. Reuse: suffix prefill measured + pull from the fit"
            " (contiguous ids; "
            "runs of 8). Model: the profile's prediction of the same.\n"
        )
        out.append(
            "| shape | cached tokens | recompute ms | reuse ms | saving | reuse ms, runs of 8 |"
            " model recompute / reuse ms |"
        )
        out.append("|" + " --- |" * 7)
        for shape, p in profiles.items():
            full = _records(prefill, shape=shape, kind="full")
            for r in _records(prefill, shape=shape, kind="suffix"):
                k, new = r["prefix_tokens"], r["new_tokens"]
                whole = _one(full, new_tokens=k + new)
                recompute_ms = whole["total_ms"] if whole else float("nan")
                reuse_ms = r["total_ms"] + pull_seconds(p, k) * 1e3
                reuse8_ms = r["total_ms"] + pull_seconds(p, k, run_blocks=8) * 1e3
                model_re = prefill_seconds(p, k + new) * 1e3
                model_reuse = model_re - ttft_saving_seconds(p, k, new) * 1e3
                out.append(
                    f"| {shape} | {k:,} | {recompute_ms:.1f} | {reuse_ms:.1f} "
                    f"| {recompute_ms / reuse_ms:.2f}x "
                    f"| {reuse8_ms:.1f} | {model_re:.1f} / {model_reuse:.1f} |"
                )
        out.append("\n## GPU_PROFILES entries (paste into services/kvferry/router/calibration.py)\n")
        out.append("```python")
        for shape, p in profiles.items():
            out.append(
                f'"{shape}": CostProfile(\n    prefill_tokens_per_second={p.prefill_tokens_per_second:.0f},\n'
                f"    transfer_bytes_per_second={p.transfer_bytes_per_second:.3g},\n"
                f"    transfer_setup_seconds={p.transfer_setup_seconds:.3g},\n"
                f"    kv_bytes_per_token={p.kv_bytes_per_token},\n"
                f"    prefill_seconds_per_token_squared={p.prefill_seconds_per_token_squared:.3g},\n"
                f"    prefill_fixed_seconds={p.prefill_fixed_seconds:.3g},\n"
                f"    transfer_seconds_per_descriptor={p.transfer_seconds_per_descriptor:.3g},\n"
                f"    descriptors_per_block={p.descriptors_per_block},\n),"
            )
        out.append("```")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
