"""EngineLimits: the limits baked into an engine, the dtypes it may hold, and its KV pool's shape."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ifb.plugins.kv_format import Q8_0_BLOCK, q8_0_block, q8_0_row_bytes
from ifb.runtime.engine_format.model_spec import ModelSpec

# What `--dtype` accepts, in the spellings vLLM and TensorRT-LLM users type, -> torch dtype names.
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# `--kv-dtype q8_0`: llama.cpp's Q8_0 for each head's K/V vector: per block of 32 values, 32 int8
# and one fp16 scale (a head of 16 is one block of 16), stored as the bytes of one uint8 pool row
# [head_dim int8 | head_dim / block fp16 scales] (plugins/kv_format.py reads and writes them).
KV_Q8_0 = "q8_0"
KV_Q8_0_BLOCK = Q8_0_BLOCK
KV_DTYPES = (*DTYPE_BYTES, KV_Q8_0)  # what an engine's KV pool may store (engine.json `kv_dtype`)


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int
    num_kv_blocks: int

    @property
    def max_blocks_per_seq(self) -> int:
        return math.ceil(self.max_seq_len / self.block_size)

    @property
    def kv_pool_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def kv_format_error(head_dim: int, kv_dtype: str) -> str | None:
    """Why a pool of `kv_dtype` cannot hold heads of `head_dim`, or None: q8_0 needs whole blocks
    of a multiple of 16 values (the decode kernel loads 16 values under one scale)."""
    if kv_dtype != KV_Q8_0:
        return None
    block = q8_0_block(head_dim)
    if head_dim % block or block % 16:
        return f"--kv-dtype q8_0 needs head_dim 16 or a multiple of {KV_Q8_0_BLOCK}, got head_dim {head_dim}"
    return None


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one head's K (or V) vector of one token in a pool of `kv_dtype`."""
    if kv_dtype == KV_Q8_0:
        return q8_0_row_bytes(head_dim)
    return head_dim * DTYPE_BYTES[kv_dtype]


def kv_pool_dtype(kv_dtype: str) -> str:
    """The torch dtype name of a `kv_dtype` pool's tensor: q8_0 rows are raw bytes."""
    return "uint8" if kv_dtype == KV_Q8_0 else kv_dtype


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: str) -> int:
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * kv_row_bytes(spec.head_dim, dtype)


def kv_pool_shape(spec: ModelSpec, limits: EngineLimits, kv_dtype: str) -> tuple[int, int, int, int, int]:
    """The paged pool: [layers, K/V, num_blocks * block_size slots, kv_heads, head_dim] elements of
    `kv_dtype`; a q8_0 pool's last axis is each head's row of bytes (`kv_row_bytes`)."""
    last = kv_row_bytes(spec.head_dim, kv_dtype) if kv_dtype == KV_Q8_0 else spec.head_dim
    return (spec.num_layers, 2, limits.kv_pool_tokens, spec.num_kv_heads, last)
