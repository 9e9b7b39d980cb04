"""Model shapes the H200 calibration measures (Qwen3 configs as published; no weights needed)."""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_SIZE_TOKENS = 16  # vLLM's default KV block size
BF16_BYTES = 2


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of K (or of V) of one 16-token block in one layer, as vLLM lays it out."""
        return BLOCK_SIZE_TOKENS * self.num_kv_heads * self.head_dim * BF16_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * BF16_BYTES


SHAPES: dict[str, ModelShape] = {
    "qwen3-8b": ModelShape("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    "qwen3-32b": ModelShape("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936),
    # A toy shape for smoke tests on a CPU machine.
    "tiny": ModelShape("tiny", 2, 256, 4, 2, 64, 512, 1024),
}

TOKEN_COUNTS = (1024, 2048, 4096, 8192, 16384, 32768)
