"""EngineLimits: the limits baked into an engine, the dtypes it may hold, and its KV pool's shape."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

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


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: str) -> int:
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * DTYPE_BYTES[dtype]


def kv_pool_shape(spec: ModelSpec, limits: EngineLimits) -> tuple[int, int, int, int, int]:
    """The paged pool: [layers, K/V, num_blocks * block_size slots, kv_heads, head_dim]."""
    return (spec.num_layers, 2, limits.kv_pool_tokens, spec.num_kv_heads, spec.head_dim)
