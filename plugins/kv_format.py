"""How a KV pool stores each head's K/V vector: as floats of the pool's dtype, or q8_0 bytes.

A pool is [num_slots, kv_heads, row] (one layer's K or V). A float pool's row is the head's
head_dim values in the pool's dtype (`--kv-dtype fp32/fp16/bf16`). A uint8 pool is `--kv-dtype
q8_0`, llama.cpp's Q8_0 applied to each head's vector: per block of 32 values (`q8_0_block`: a
head of 16 is one block of 16) one fp16 scale d = max|x| / 127 and 32 int8 q = round(x / d),
the value read back being q * d. The row is the bytes

    [ q: head_dim int8 | d: head_dim / block fp16 ]        (head_dim 64: 64 + 4 = 68 bytes)

so a token costs 1.06 bytes a value against fp16's 2, and a block of the pool is still one
contiguous run of slots (the prefix disk tier copies it as bytes, whatever the format).

Each token's row is a function of that token's K/V alone (its own blocks' maxima, one rounding
to fp16 of d, one rounding of x / d), so what a request stores never depends on the step's other
rows. q * d is exact in fp32 (8 + 11 significant bits), so every reader (this module's
`dequantize_q8_0`, the C++ decode kernel) sees the same values bit for bit.
"""

from __future__ import annotations

import torch

from ifb.plugins.casts import cast

Q8_0_BLOCK = 32  # values per fp16 scale, as llama.cpp's Q8_0
Q8_0_POOL_DTYPE = torch.uint8  # the dtype that marks a pool as q8_0 rows
Q8_0_MAX = 127


def q8_0_block(head_dim: int) -> int:
    """Values per scale of a q8_0 head vector: 32, or the whole head where head_dim is 16."""
    return min(Q8_0_BLOCK, head_dim)


def q8_0_row_bytes(head_dim: int) -> int:
    """Bytes of one head's q8_0 row: its int8 values, then its fp16 scales."""
    return head_dim + 2 * (head_dim // q8_0_block(head_dim))


def is_q8_0(pool: torch.Tensor) -> bool:
    return pool.dtype == Q8_0_POOL_DTYPE


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (any float dtype) -> q8_0 rows uint8 [..., head_dim + 2 * head_dim / block].

    d is rounded to fp16 first and x divided by that stored d, so q * d is the closest the row can
    hold; the fp16 d may round below max|x| / 127, hence the clamp to +-127 (at most half a step)."""
    head_dim = x.shape[-1]
    block = q8_0_block(head_dim)
    blocks = x.float().reshape(*x.shape[:-1], head_dim // block, block)
    d = (blocks.abs().amax(dim=-1, keepdim=True) / Q8_0_MAX).to(torch.float16)
    wide_d = d.float()
    # a block of zeros has d = 0: its q are 0 (not 0 / 0)
    q = torch.where(wide_d == 0, torch.zeros_like(blocks), blocks / wide_d)
    q = torch.round(q).clamp(-Q8_0_MAX, Q8_0_MAX).to(torch.int8)
    values = q.reshape(*x.shape[:-1], head_dim).view(torch.uint8)
    scales = d.reshape(*x.shape[:-1], head_dim // block).view(torch.uint8)
    return torch.cat([values, scales], dim=-1)


def q8_0_head_dim(row_bytes: int) -> int:
    """The head_dim of a q8_0 row of `row_bytes` (the inverse of `kv_row_bytes`: 18 -> 16, 68 -> 64)."""
    head_dim = 16 if row_bytes == 18 else row_bytes * 16 // 17
    if q8_0_row_bytes(head_dim) != row_bytes:
        raise ValueError(f"{row_bytes} bytes is no q8_0 row (head_dim 16 or a multiple of 32)")
    return head_dim


def dequantize_q8_0(rows: torch.Tensor) -> torch.Tensor:
    """q8_0 rows uint8 [..., row] -> float32 [..., head_dim], exactly q * d."""
    head_dim = q8_0_head_dim(rows.shape[-1])
    block = q8_0_block(head_dim)
    q = rows[..., :head_dim].view(torch.int8).float()
    d = rows[..., head_dim:].contiguous().view(torch.float16).float()
    blocks = q.reshape(*q.shape[:-1], head_dim // block, block) * d[..., None]
    return blocks.reshape(q.shape)


def encode(pool: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """K or V [T, kv_heads, head_dim] as rows of `pool`'s format (rounded once, to nearest)."""
    return quantize_q8_0(x) if is_q8_0(pool) else cast(x, pool.dtype)


def decode(rows: torch.Tensor) -> torch.Tensor:
    """Rows read from a pool (any leading shape) as values: q8_0 dequantized to fp32, float rows as stored."""
    return dequantize_q8_0(rows) if is_q8_0(rows) else rows
