"""The KV compatibility hash: defined once, used as the block-digest salt and the registry's
``Engine.kv_compatibility_hash``.

Two engines can exchange KV blocks only when the served model and its KV layout match. The
connector computes the hash from the engine's vLLM config at start; a launcher (or sidecar)
computes the same value from the model directory and the engine's flags with
:func:`layout_from_model_dir`. Pure Python: no vLLM import.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

_HASH_VERSION = "kvferry-kv-compat-v1"


@dataclass(frozen=True)
class KvLayout:
    """What decides whether two engines' KV blocks are interchangeable."""

    # Served model name (weights identity).
    model: str
    # Compute dtype, e.g. "float32" (no "torch." prefix).
    dtype: str
    # KV cache dtype, resolved ("auto" means the compute dtype).
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int


def normalize_dtype(name: str) -> str:
    name = name.removeprefix("torch.")
    return {
        "half": "float16",
        "fp16": "float16",
        "bf16": "bfloat16",
        "float": "float32",
        "fp32": "float32",
    }.get(name, name)


def kv_compatibility_hash(layout: KvLayout) -> str:
    """A short, stable hex digest of ``layout``."""
    fields = asdict(layout)
    fields["dtype"] = normalize_dtype(layout.dtype)
    kv_dtype = normalize_dtype(layout.kv_cache_dtype)
    fields["kv_cache_dtype"] = fields["dtype"] if kv_dtype == "auto" else kv_dtype
    payload = json.dumps([_HASH_VERSION, fields], sort_keys=True).encode()
    return hashlib.sha256(payload).hexdigest()[:32]


def layout_from_model_dir(
    model_dir: Path | str,
    *,
    served_model_name: str,
    block_size: int,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
) -> KvLayout:
    """The layout an engine started on ``model_dir`` with these flags will have."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    num_heads = int(config["num_attention_heads"])
    head_size = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
    resolved_dtype = (
        (config.get("torch_dtype") or config.get("dtype") or "float32") if dtype == "auto" else dtype
    )
    return KvLayout(
        model=served_model_name,
        dtype=normalize_dtype(str(resolved_dtype)),
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        num_layers=int(config["num_hidden_layers"]),
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_size=head_size,
    )
