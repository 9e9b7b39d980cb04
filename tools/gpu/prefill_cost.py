"""Prefill cost on one GPU: a torch Qwen3 decoder stack of the real layer shapes, random bf16 weights.

Every layer of the model is built and run (no layer scaling): RMSNorm, fused QKV projection, per-head q/k
RMSNorm, rotary embedding, causal GQA attention (torch SDPA, the fastest backend that runs here), output
projection, RMSNorm, fused gate/up projection, SiLU, down projection; the embedding lookup in front, the final
norm and the LM head on the last token only, as an engine computes logits for the next token only.

Two measurements:
- full prefill of N tokens (no cache), N in 1k..32k;
- suffix prefill: S new tokens whose first K tokens' KV is already cached (what P computes after a pull),
  attention over K + S keys with the causal mask aligned bottom-right.

Timing: CUDA events around the whole forward, warm-ups first, median of the repetitions.
Run: python tools/gpu/prefill_cost.py --out prefill.json
Smoke test without a GPU: --device cpu --shapes tiny --tokens 64,128
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# Run as a script from anywhere: the repository root makes tools.gpu importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tools.gpu.model_shapes import SHAPES, TOKEN_COUNTS, ModelShape

ROPE_THETA = 1_000_000.0
RMS_EPS = 1e-6
WEIGHT_STD = 0.02


class Layer:
    def __init__(self, shape: ModelShape, device: torch.device, generator: torch.Generator) -> None:
        h, hd = shape.hidden_size, shape.head_dim
        q, kv = shape.num_heads * hd, shape.num_kv_heads * hd

        def weight(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, dtype=torch.bfloat16, generator=generator) * WEIGHT_STD

        self.shape = shape
        self.input_norm = torch.ones(h, device=device, dtype=torch.bfloat16)
        self.qkv = weight(q + 2 * kv, h)
        self.q_norm = torch.ones(hd, device=device, dtype=torch.bfloat16)
        self.k_norm = torch.ones(hd, device=device, dtype=torch.bfloat16)
        self.o = weight(h, q)
        self.post_norm = torch.ones(h, device=device, dtype=torch.bfloat16)
        self.gate_up = weight(2 * shape.intermediate_size, h)
        self.down = weight(h, shape.intermediate_size)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, RMS_EPS)


def rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (
        ROPE_THETA ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [heads, tokens, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


SUFFIX_METHODS = ("split_cudnn", "split_flash", "bias_native_gqa", "bias_repeat")


def _attention_with_lse(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and log-sum-exp per query, [1, H, L, D] inputs, equal head counts."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if kernel == "math":  # reference in float32, for checking the split on any device
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            n = scores.shape[-1]
            scores = scores.masked_fill(
                torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        lse = torch.logsumexp(scores, dim=-1)
        return (torch.softmax(scores, dim=-1) @ v.float()).to(q.dtype), lse
    if kernel == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


class Attention:
    """Causal GQA attention through SDPA with a fixed backend choice, and a fixed method for suffixes."""

    def __init__(
        self, backend: SDPBackend | None, native_gqa: bool, suffix_method: str = "bias_repeat"
    ) -> None:
        self.backend = backend
        self.native_gqa = native_gqa
        self.suffix_method = suffix_method

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Full causal attention. q: [Hq, N, D]; k, v: [Hkv, N, D]."""
        groups = q.shape[0] // k.shape[0]
        kwargs: dict[str, Any] = {"is_causal": True}
        if groups > 1:
            if self.native_gqa:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(groups, dim=0)
                v = v.repeat_interleave(groups, dim=0)
        q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if self.backend is None:
            return F.scaled_dot_product_attention(q4, k4, v4, **kwargs)[0]
        with sdpa_kernel(self.backend):
            return F.scaled_dot_product_attention(q4, k4, v4, **kwargs)[0]

    def suffix(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cached: torch.Tensor,
        v_cached: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of S new queries over cached and new keys (causal mask aligned bottom-right).

        q: [Hq, S, D]; k, v: [Hkv, S, D] of the new tokens; k_cached, v_cached: [Hkv, K, D].
        """
        if k_cached.shape[1] == 0:
            return self(q, k, v)
        hq, s, d = q.shape
        hkv = k.shape[0]
        groups = hq // hkv
        if self.suffix_method.startswith("split"):
            # Cached keys: no mask, so the query heads of a group fold into one sequence (GQA without copies);
            # new keys: a square causal block. The two halves merge by their log-sum-exp.
            kernel = self.suffix_method.removeprefix("split_")
            out_a, lse_a = _attention_with_lse(
                kernel, q.reshape(1, hkv, groups * s, d), k_cached.unsqueeze(0), v_cached.unsqueeze(0), False
            )
            k_new = k.repeat_interleave(groups, dim=0).unsqueeze(0)
            v_new = v.repeat_interleave(groups, dim=0).unsqueeze(0)
            out_b, lse_b = _attention_with_lse(kernel, q.unsqueeze(0), k_new, v_new, True)
            out_a, lse_a = out_a.reshape(hq, s, d), lse_a.reshape(hq, s)
            out_b, lse_b = out_b.reshape(hq, s, d), lse_b.reshape(hq, s)
            lse = torch.logaddexp(lse_a, lse_b)
            merged = out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(
                -1
            )
            return merged.to(q.dtype)
        from torch.nn.attention.bias import causal_lower_right

        k_all = torch.cat([k_cached, k], dim=1)
        v_all = torch.cat([v_cached, v], dim=1)
        kwargs: dict[str, Any] = {"attn_mask": causal_lower_right(s, k_all.shape[1])}
        if self.suffix_method == "bias_native_gqa":
            kwargs["enable_gqa"] = True
        else:
            k_all = k_all.repeat_interleave(groups, dim=0)
            v_all = v_all.repeat_interleave(groups, dim=0)
        # SDPA's CausalBias picks its own kernel for a bottom-right mask, so no backend is forced here.
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), k_all.unsqueeze(0), v_all.unsqueeze(0), **kwargs
        )[0]


class Model:
    def __init__(self, shape: ModelShape, device: torch.device, num_layers: int, seed: int = 0) -> None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        self.shape = shape
        self.device = device
        self.embed = (
            torch.randn(
                shape.vocab_size, shape.hidden_size, device=device, dtype=torch.bfloat16, generator=generator
            )
            * WEIGHT_STD
        )
        self.layers = [Layer(shape, device, generator) for _ in range(num_layers)]
        self.final_norm = torch.ones(shape.hidden_size, device=device, dtype=torch.bfloat16)
        self.lm_head = (
            torch.randn(
                shape.vocab_size, shape.hidden_size, device=device, dtype=torch.bfloat16, generator=generator
            )
            * WEIGHT_STD
        )
        self.attention = Attention(None, False)

    def forward(
        self, token_ids: torch.Tensor, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """Logits of the last position. prefix_kv: per layer cached (K, V) [Hkv, K, D] of earlier tokens."""
        s = self.shape
        prefix_len = 0 if prefix_kv is None else prefix_kv[0][0].shape[1]
        positions = torch.arange(prefix_len, prefix_len + token_ids.shape[0], device=self.device)
        cos, sin = rope_tables(positions, s.head_dim)
        x = F.embedding(token_ids, self.embed)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for index, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm)
            qkv = F.linear(h, layer.qkv)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = rms_norm(q.view(-1, s.num_heads, s.head_dim), layer.q_norm).transpose(0, 1)
            k = rms_norm(k.view(-1, s.num_kv_heads, s.head_dim), layer.k_norm).transpose(0, 1)
            v = v.view(-1, s.num_kv_heads, s.head_dim).transpose(0, 1)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            if prefix_kv is None:
                attn = self.attention(q, k, v)
            else:
                attn = self.attention.suffix(q, k, v, prefix_kv[index][0], prefix_kv[index][1])
            attn = attn.transpose(0, 1).reshape(-1, q_size)
            x = x + F.linear(attn, layer.o)
            h = rms_norm(x, layer.post_norm)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        last = rms_norm(x[-1:], self.final_norm)
        return F.linear(last, self.lm_head)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> list[float]:
    times = []
    for rep in range(warmup + reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t0) * 1e3
        if rep >= warmup:
            times.append(elapsed)
    return times


def choose_attention(
    shape: ModelShape, device: torch.device, probe_tokens: int
) -> tuple[Attention, list[dict[str, Any]]]:
    """Try each SDPA backend on one layer's attention; keep the fastest that agrees with the reference."""
    g = torch.Generator(device=device)
    g.manual_seed(1)
    q = torch.randn(
        shape.num_heads, probe_tokens, shape.head_dim, device=device, dtype=torch.bfloat16, generator=g
    )
    k = torch.randn(
        shape.num_kv_heads, probe_tokens, shape.head_dim, device=device, dtype=torch.bfloat16, generator=g
    )
    v = torch.randn(
        shape.num_kv_heads, probe_tokens, shape.head_dim, device=device, dtype=torch.bfloat16, generator=g
    )
    n_ref = min(probe_tokens, 1024)
    ref = Attention(SDPBackend.MATH, False)(q[:, :n_ref].float(), k[:, :n_ref].float(), v[:, :n_ref].float())
    candidates: list[tuple[SDPBackend, bool]] = []
    if device.type == "cuda":
        for backend in (
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
        ):
            candidates += [(backend, True), (backend, False)]
    else:
        candidates = [(SDPBackend.MATH, False)]
    report = []
    best: tuple[float, Attention] | None = None
    for backend, native_gqa in candidates:
        attention = Attention(backend, native_gqa)
        entry: dict[str, Any] = {"backend": backend.name, "native_gqa": native_gqa}
        try:
            out = attention(q[:, :n_ref], k[:, :n_ref], v[:, :n_ref]).float()
            rel = float((out - ref).norm() / ref.norm())
            entry["rel_err"] = rel
            if not rel < 2e-2:
                entry["error"] = "wrong result"
            else:
                entry["ms"] = statistics.median(time_ms(functools.partial(attention, q, k, v), device, 2, 5))
                if best is None or entry["ms"] < best[0]:
                    best = (entry["ms"], attention)
        except Exception as exc:  # a backend that does not support this case is skipped, and reported
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        report.append(entry)
        print(f"attention probe {shape.name} {probe_tokens} tok: {entry}", flush=True)
    if best is None:
        raise RuntimeError("no SDPA backend ran")
    chosen = best[1]
    chosen.suffix_method = _choose_suffix_method(shape, device, chosen, report)
    return chosen, report


def _choose_suffix_method(
    shape: ModelShape, device: torch.device, chosen: Attention, report: list[dict[str, Any]]
) -> str:
    """Check each suffix method against an explicit bottom-right mask; keep the fastest correct one."""
    g = torch.Generator(device=device)
    g.manual_seed(3)

    def inputs(cached: int, new: int) -> tuple[torch.Tensor, ...]:
        def r(h: int, n: int) -> torch.Tensor:
            return torch.randn(h, n, shape.head_dim, device=device, dtype=torch.bfloat16, generator=g)

        return (
            r(shape.num_heads, new),
            r(shape.num_kv_heads, new),
            r(shape.num_kv_heads, new),
            r(shape.num_kv_heads, cached),
            r(shape.num_kv_heads, cached),
        )

    q, k, v, kc, vc = inputs(192, 64)
    groups = shape.num_heads // shape.num_kv_heads
    k_all = torch.cat([kc, k], dim=1).float().repeat_interleave(groups, 0)
    v_all = torch.cat([vc, v], dim=1).float().repeat_interleave(groups, 0)
    allowed = torch.arange(256, device=device)[None, :] <= (192 + torch.arange(64, device=device))[:, None]
    ref = F.scaled_dot_product_attention(q.float()[None], k_all[None], v_all[None], attn_mask=allowed)[0]
    big = inputs(14336, 2048) if device.type == "cuda" else inputs(256, 64)
    best: tuple[float, str] | None = None
    methods = SUFFIX_METHODS if device.type == "cuda" else ("split_math", *SUFFIX_METHODS[2:])
    for method in methods:
        attention = Attention(chosen.backend, chosen.native_gqa, method)
        entry: dict[str, Any] = {"suffix_method": method}
        try:
            out = attention.suffix(q, k, v, kc, vc).float()
            entry["rel_err"] = float((out - ref).norm() / ref.norm())
            if not entry["rel_err"] < 2e-2:
                entry["error"] = "wrong result"
            else:
                entry["ms_2048_after_14336"] = statistics.median(
                    time_ms(functools.partial(attention.suffix, *big), device, 2, 5)
                )
                if best is None or entry["ms_2048_after_14336"] < best[0]:
                    best = (entry["ms_2048_after_14336"], method)
        except Exception as exc:  # a method this torch build cannot run is skipped, and reported
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        report.append(entry)
        print(f"attention probe {shape.name} suffix: {entry}", flush=True)
    if best is None:
        raise RuntimeError("no suffix attention method agrees with the explicit causal mask")
    return best[1]


def flops_full(shape: ModelShape, n: int) -> float:
    """Matrix FLOPs of a full prefill of n tokens (causal attention counted as half the square)."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    per_token_params = (
        shape.hidden_size * (q + 2 * kv)
        + q * shape.hidden_size
        + 3 * shape.hidden_size * shape.intermediate_size
    )
    linear = 2.0 * per_token_params * n * shape.num_layers + 2.0 * shape.hidden_size * shape.vocab_size
    attention = 4.0 * shape.num_heads * shape.head_dim * (n * n / 2.0) * shape.num_layers
    return float(linear + attention)


def measure_shape(
    shape: ModelShape,
    device: torch.device,
    tokens: list[int],
    suffix_cases: list[tuple[int, int]],
    warmup: int,
    reps: int,
    num_layers: int,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = Model(shape, device, num_layers)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - t0
    attention, probe = choose_attention(shape, device, min(8192, max(tokens)))
    model.attention = attention
    layer_scale = shape.num_layers / num_layers
    records: list[dict[str, Any]] = []
    g = torch.Generator(device=device)
    g.manual_seed(2)
    with torch.inference_mode():
        for n in tokens:
            ids = torch.randint(0, shape.vocab_size, (n,), device=device, generator=g)
            logits = model.forward(ids)
            if not torch.isfinite(logits.float()).all():
                raise RuntimeError(f"non-finite logits for {shape.name} at {n} tokens")
            times = [
                t * layer_scale for t in time_ms(functools.partial(model.forward, ids), device, warmup, reps)
            ]
            total = statistics.median(times)
            rec = {
                "shape": shape.name,
                "kind": "full",
                "prefix_tokens": 0,
                "new_tokens": n,
                "total_ms": total,
                "total_ms_min": min(times),
                "total_ms_max": max(times),
                "us_per_token": total * 1e3 / n,
                "tokens_per_s": n / (total * 1e-3),
                "tflops": flops_full(shape, n) / (total * 1e-3) / 1e12,
                "layers_run": num_layers,
                "reps": reps,
            }
            records.append(rec)
            print(
                f"prefill {shape.name:9s} full   {n:6d} tok {total:9.2f} ms"
                f" {rec['us_per_token']:7.2f} us/tok "
                f"{rec['tflops']:6.1f} TFLOP/s",
                flush=True,
            )
        for prefix, new in suffix_cases:
            prefix_kv = [
                (
                    torch.randn(
                        shape.num_kv_heads,
                        prefix,
                        shape.head_dim,
                        device=device,
                        dtype=torch.bfloat16,
                        generator=g,
                    ),
                    torch.randn(
                        shape.num_kv_heads,
                        prefix,
                        shape.head_dim,
                        device=device,
                        dtype=torch.bfloat16,
                        generator=g,
                    ),
                )
                for _ in range(num_layers)
            ]
            ids = torch.randint(0, shape.vocab_size, (new,), device=device, generator=g)
            times = [
                t * layer_scale
                for t in time_ms(functools.partial(model.forward, ids, prefix_kv), device, warmup, reps)
            ]
            total = statistics.median(times)
            records.append(
                {
                    "shape": shape.name,
                    "kind": "suffix",
                    "prefix_tokens": prefix,
                    "new_tokens": new,
                    "total_ms": total,
                    "total_ms_min": min(times),
                    "total_ms_max": max(times),
                    "layers_run": num_layers,
                    "reps": reps,
                }
            )
            print(
                f"prefill {shape.name:9s} suffix {new:6d} new after {prefix:6d} cached {total:9.2f} ms",
                flush=True,
            )
            del prefix_kv
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "setup": {
            "shape": shape.name,
            "build_s": build_s,
            "layers_run": num_layers,
            "layers_in_model": shape.num_layers,
            "attention": {
                "backend": attention.backend.name if attention.backend else "default",
                "native_gqa": attention.native_gqa,
                "suffix_method": attention.suffix_method,
            },
            "attention_probe": probe,
        },
        "records": records,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3-8b,qwen3-32b")
    parser.add_argument("--tokens", default=",".join(str(t) for t in TOKEN_COUNTS))
    parser.add_argument("--suffix-new", type=int, default=2048, help="new tokens of the suffix prefills")
    parser.add_argument(
        "--suffix-prefixes", default="0,2048,6144,14336,30720", help="cached tokens before the suffix"
    )
    parser.add_argument(
        "--layers", type=int, default=0, help="layers to build and run (0: all; else times are scaled)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    tokens = [int(t) for t in args.tokens.split(",") if t]
    suffix_cases = [
        (int(p), args.suffix_new) for p in args.suffix_prefixes.split(",") if p and args.suffix_new > 0
    ]
    result: dict[str, Any] = {"setup": [], "records": []}
    if device.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(device)
    result["torch"] = torch.__version__
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        layers = args.layers or shape.num_layers
        out = measure_shape(
            shape, device, tokens, suffix_cases, args.warmup, args.reps, min(layers, shape.num_layers)
        )
        result["setup"].append(out["setup"])
        result["records"] += out["records"]
        with open(args.out, "w") as f:  # written after each shape, so a cut-off run keeps what it measured
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
