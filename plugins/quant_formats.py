"""GGUF block formats Q4_0, Q4_1 and Q8_0: byte layouts, pure-torch dequantize and quantize.

A weight [N, K] is stored as N rows of K/32 blocks, exactly as in a GGUF file:

    Q4_0  18 B: fp16 d | 16 B nibbles          w = (q - 8) * d
    Q4_1  20 B: fp16 d | fp16 m | 16 B nibbles w = q * d + m      (two fp32 roundings)
    Q8_0  34 B: fp16 d | 32 x int8             w = q * d

Nibble byte i of a block holds element i (low nibble) and element i + 16 (high nibble).
`dequantize` reproduces `gguf.quants.dequantize` bit for bit (same fp32 operations in the same
order); `quantize` is GGUF's round-to-nearest quantizer per 32-weight block, so HF weights
quantized at build time give the bytes llama.cpp's `convert_hf_to_gguf.py` would write.
"""

from __future__ import annotations

from enum import Enum

import torch

BLOCK_SIZE = 32


class WeightFormat(str, Enum):
    """How a linear layer's weight is stored in an engine."""

    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q8_0 = "q8_0"
    FP32 = "fp32"

    @property
    def is_block(self) -> bool:
        return self is not WeightFormat.FP32


class WeightCompute(str, Enum):
    """How block-quantized layers multiply (`ifb build --compute`).

    fp32: fp32 activations times the exact dequantized weights (the engine's numbers equal the
    fp32 engine's up to summation order). int8: activations quantized per row and 32-block to
    int8 and integer dot products (llama.cpp's Q8_1 pairing): faster when compute bound, opt-in,
    its quality measured in bench/quality.py.
    """

    FP32 = "fp32"
    INT8 = "int8"


_BLOCK_BYTES = {WeightFormat.Q4_0: 18, WeightFormat.Q4_1: 20, WeightFormat.Q8_0: 34}


def block_bytes(fmt: WeightFormat) -> int:
    """Bytes of one 32-weight block of `fmt`."""
    if fmt not in _BLOCK_BYTES:
        raise ValueError(f"{fmt.value} is not a block format")
    return _BLOCK_BYTES[fmt]


def _halves(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at `offset` of each block, as fp32 [num_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 16] bytes -> [num_blocks, 32] values: low nibbles first, then high."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def dequantize(blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """uint8 [N, K/32 * block_bytes] -> fp32 [N, K], bit-equal to gguf.quants.dequantize."""
    size = block_bytes(fmt)
    rows = blocks.shape[0]
    flat = blocks.reshape(-1, size)
    d = _halves(flat, 0)
    if fmt is WeightFormat.Q4_0:
        q = (_nibbles(flat[:, 2:]).to(torch.int8) - 8).to(torch.float32)
        weights = d * q
    elif fmt is WeightFormat.Q4_1:
        m = _halves(flat, 2)
        weights = (d * _nibbles(flat[:, 4:]).to(torch.float32)) + m  # two roundings, as numpy
    else:
        weights = flat[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
    return weights.reshape(rows, -1)


def _roundf(values: torch.Tensor) -> torch.Tensor:
    """C roundf (halves away from zero), written as gguf's np_roundf."""
    magnitude = values.abs()
    floored = torch.floor(magnitude)
    return torch.sign(values) * (floored + torch.floor(2 * (magnitude - floored)))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 32] values 0..15 -> [num_blocks, 16] bytes, element i + 16 in the high nibble."""
    return q[:, :16] | (q[:, 16:] << 4)


def quantize(weight: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """fp32 [N, K] (K a multiple of 32) -> uint8 [N, K/32 * block_bytes], GGUF round-to-nearest."""
    rows, cols = weight.shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"K must be a multiple of {BLOCK_SIZE} to quantize to {fmt.value}, got {cols}")
    blocks = weight.to(torch.float32).reshape(-1, BLOCK_SIZE)
    if fmt is WeightFormat.Q4_0:
        peak = torch.gather(blocks, 1, blocks.abs().argmax(dim=1, keepdim=True))
        d = peak / -8
        q = torch.trunc(blocks * _inverse(d) + 8.5).to(torch.uint8).clamp(0, 15)
        fields = [_fp16_bytes(d), _pack_nibbles(q)]
    elif fmt is WeightFormat.Q4_1:
        high = blocks.max(dim=1, keepdim=True).values
        low = blocks.min(dim=1, keepdim=True).values
        d = (high - low) / 15
        q = torch.trunc((blocks - low) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 15)
        fields = [_fp16_bytes(d), _fp16_bytes(low), _pack_nibbles(q)]
    elif fmt is WeightFormat.Q8_0:
        d = blocks.abs().max(dim=1, keepdim=True).values / 127
        q = _roundf(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
        fields = [_fp16_bytes(d), q]
    else:
        raise ValueError(f"{fmt.value} is not a block format")
    return torch.cat(fields, dim=1).reshape(rows, -1)
