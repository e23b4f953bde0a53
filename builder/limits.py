"""Resolve and check the limits `ifb build` bakes into an engine, against the model and each other."""

from __future__ import annotations

import math

from ifb.builder.errors import BuildError, LimitsError
from ifb.runtime.engine_format import (
    DTYPE_ALIASES,
    DTYPE_BYTES,
    KV_Q8_0,
    BackendKind,
    EngineLimits,
    ModelSpec,
    kv_bytes_per_block,
    kv_format_error,
)

DTYPES = ("bfloat16", "float32")  # the CPU backend's; the tensorrt backend adds float16
# `--kv-dtype`: auto = the engine's dtype; q8_0 = int8 values with an fp16 scale per 32 (engine_format.limits)
KV_DTYPE_CHOICES = ("auto", *DTYPE_ALIASES, KV_Q8_0)


def cpu_has_bf16_matmul() -> bool:
    """True where the CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16)."""
    import torch

    try:
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except AttributeError:  # older torch: assume no hardware bf16
        return False


def normalize_dtype(dtype: str) -> str:
    """`auto` picks bf16 where the CPU has bf16 matrix units, else fp32 (bf16 is emulated and
    3-10x slower than fp32 from a few rows up on AVX2-only machines, measured in bench/step.py)."""
    if dtype == "auto":
        return "bfloat16" if cpu_has_bf16_matmul() else "float32"
    if DTYPE_ALIASES.get(dtype) not in DTYPES:
        raise LimitsError(
            f"dtype {dtype!r} is not supported by the cpu backend; choose one of auto, bfloat16 (bf16), float32 (fp32)"
        )
    return DTYPE_ALIASES[dtype]


def check_kv_dtype_option(kv_dtype: str, backend: BackendKind) -> None:
    """Refuse a `--kv-dtype` no backend can build, before any work. The tensorrt backend keeps
    its pool in the plan's dtype (already bf16/fp16 with `--dtype auto`), and its plan reads the
    pool as its own dtype: a narrower pool there has never run, so it is refused, not guessed."""
    if kv_dtype not in KV_DTYPE_CHOICES:
        raise BuildError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPE_CHOICES)}")
    if kv_dtype != "auto" and backend is not BackendKind.CPU:
        raise BuildError(
            f"--kv-dtype {kv_dtype} needs --backend cpu: the {backend.value} backend stores the KV cache in the "
            "engine's --dtype (bf16/fp16 with auto); drop --kv-dtype or pick --dtype instead"
        )


def resolve_kv_dtype(kv_dtype: str, dtype: str) -> str:
    """The KV pool's dtype for an engine computing in `dtype`: `auto` is `dtype`; a dtype wider
    than the step's is refused (it would store bits the step never computed); q8_0 is narrower
    than every dtype."""
    if kv_dtype in ("auto", KV_Q8_0):
        return dtype if kv_dtype == "auto" else KV_Q8_0
    resolved = DTYPE_ALIASES[kv_dtype]
    if DTYPE_BYTES[resolved] > DTYPE_BYTES[dtype]:
        raise LimitsError(
            f"--kv-dtype {kv_dtype} is wider than the engine's dtype {dtype}: the KV cache can only be "
            f"as wide as what the step computes; use --kv-dtype auto (= {dtype})"
        )
    return resolved


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise LimitsError(f"{name} must be >= 1, got {value}")


def resolve_limits(
    spec: ModelSpec,
    *,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
    block_size: int,
    kv_dtype: str,
    kv_blocks: int | None = None,
    kv_memory_gb: float | None = None,
) -> EngineLimits:
    """Check every requested limit against the model and each other; size the KV pool
    (`kv_memory_gb` in blocks of `kv_dtype`: an fp16 pool holds twice an fp32 one's blocks, a
    q8_0 one 1.88x an fp16 one's at head_dim 64)."""
    for name, value in [
        ("max_batch_size", max_batch_size),
        ("max_num_tokens", max_num_tokens),
        ("max_seq_len", max_seq_len),
        ("block_size", block_size),
    ]:
        _positive(name, value)
    if (error := kv_format_error(spec.head_dim, kv_dtype)) is not None:
        raise LimitsError(error)
    if block_size & (block_size - 1):
        raise LimitsError(f"block_size must be a power of two, got {block_size}")
    if max_seq_len > spec.max_position_embeddings:
        raise LimitsError(
            f"max_seq_len {max_seq_len} exceeds the model's position limit "
            f"max_position_embeddings={spec.max_position_embeddings}"
        )
    if max_num_tokens < max_batch_size:
        raise LimitsError(
            f"max_num_tokens {max_num_tokens} must be >= max_batch_size {max_batch_size} "
            "(every running request decodes one token per step)"
        )
    if kv_blocks is not None and kv_memory_gb is not None:
        raise LimitsError("give either kv_blocks or kv_memory, not both")
    blocks_per_seq = math.ceil(max_seq_len / block_size)
    if kv_memory_gb is not None:
        kv_blocks = int(kv_memory_gb * 1e9 // kv_bytes_per_block(spec, block_size, kv_dtype))
    if kv_blocks is None:
        kv_blocks = max_batch_size * blocks_per_seq  # every seat can hold a full-length request
    if kv_blocks < blocks_per_seq:
        raise LimitsError(
            f"KV pool of {kv_blocks} blocks is smaller than one full-length request: "
            f"max_seq_len {max_seq_len} needs {blocks_per_seq} blocks of {block_size} tokens"
        )
    return EngineLimits(max_batch_size, max_num_tokens, max_seq_len, block_size, kv_blocks)
