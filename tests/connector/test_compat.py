"""The KV compatibility hash: one definition for the connector, launchers and sidecars."""

from __future__ import annotations

from dataclasses import replace

from kvferry.connector.compat import KvLayout, kv_compatibility_hash, layout_from_model_dir
from kvferry.stack.engine import DEFAULT_MODEL_DIR

LAYOUT = KvLayout(
    model="tiny-qwen3",
    dtype="torch.float32",
    kv_cache_dtype="auto",
    block_size=32,
    num_layers=4,
    num_kv_heads=2,
    head_size=64,
)


def test_hash_is_stable_and_normalises_dtype_spellings() -> None:
    same = replace(LAYOUT, dtype="float32", kv_cache_dtype="float32")
    assert kv_compatibility_hash(LAYOUT) == kv_compatibility_hash(same)
    assert len(kv_compatibility_hash(LAYOUT)) == 32


def test_any_layout_change_changes_the_hash() -> None:
    base = kv_compatibility_hash(LAYOUT)
    for change in ({"model": "other"}, {"block_size": 16}, {"num_layers": 5}, {"dtype": "bfloat16"}):
        assert kv_compatibility_hash(replace(LAYOUT, **change)) != base  # type: ignore[arg-type]


def test_layout_from_the_repo_model_dir_matches_what_the_engine_reports() -> None:
    layout = layout_from_model_dir(DEFAULT_MODEL_DIR, served_model_name="tiny-qwen3", block_size=32)
    assert layout == replace(LAYOUT, dtype="float32")
