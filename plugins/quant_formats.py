"""GGUF block formats (legacy 32-weight and K-quant 256-weight): byte layouts, pure-torch dequantize and quantize.

A weight [N, K] is stored as N rows of K/block_weights blocks, exactly as in a GGUF file:

    Q4_0   18 B: fp16 d | 16 B nibbles                     w = (q - 8) * d
    Q4_1   20 B: fp16 d | fp16 m | 16 B nibbles            w = q * d + m      (two fp32 roundings)
    Q8_0   34 B: fp16 d | 32 x int8                        w = q * d
    Q5_0   22 B: fp16 d | u32 qh | 16 B nibbles            w = (q - 16) * d   (qh bit e: 5th bit of e)
    Q5_1   24 B: fp16 d | fp16 m | u32 qh | 16 B nibbles   w = q * d + m
    Q4_K  144 B: fp16 d | fp16 dmin | 12 B 6-bit scales/mins | 128 B nibbles       w = (d*sc) q - (dmin*m)
    Q5_K  176 B: as Q4_K with 32 B of 5th bits before the nibbles
    Q6_K  210 B: 128 B low nibbles | 64 B 2-bit highs | 16 x int8 scales | fp16 d  w = (d*sc) (q - 32)
    MXFP4  17 B: u8 e (e8m0) | 16 B nibbles (e2m1 codes)  w = 2^(e-128) * MXFP4_VALUES[q]

Legacy nibble byte i holds element i (low nibble) and i + 16 (high); MXFP4's too. The K-quants'
element order is in ../shared/gguf-formats.md (and `k_quant_values` below). MXFP4 is ggml's: the
e2m1 code's value doubled (integers, |v| <= 12) times half the e8m0 scale, 2^(e-128), which for
e = 0 and 1 is an fp32 subnormal (exact) and times 12 overflows to inf for e >= 254, as in gguf.
`dequantize` reproduces `gguf.quants.dequantize` bit for bit (same fp32 operations in the same
order); `quantize` is GGUF's round-to-nearest quantizer for the legacy 32-weight formats (gguf has
none for the K-quants), so HF weights quantized at build time give the bytes llama.cpp's
`convert_hf_to_gguf.py` would write; `quantize_mxfp4` is gguf's (and ggml's) MXFP4 quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch

# MXFP4's 16 codes -> the e2m1 value times 2 (ggml's kvalues_mxfp4): sign bit 3, then 0..6 in e2m1
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
BLOCK_SIZE = 32  # weights of a legacy block, and of each sub-block the kernels step through
SUPER_BLOCK = 256  # weights of a K-quant super-block


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """One GGUF block of a format: its bytes, and the weights it holds along K."""

    bytes: int
    weights: int
    quantizable: bool = False  # `quantize` writes it from fp32 weights (`ifb build --weights`)


class WeightFormat(str, Enum):
    """How a linear layer's weight is stored in an engine: fp32, or a GGUF block format.

    The one list of block formats, from the builder to the kernels: the value is the name
    engine.json's weight_formats records and the ifb_quant ops take (their kernel format code),
    the member name is GGUF's tensor type name, and the layout gives the block's size. Every
    block format here has a kernel: plugins/csrc/block_format_table.h is generated from this
    enum (`python -m ifb.plugins.quant_formats`), and quant_kernels.h's Format, its kFormats
    table and block_formats.h's switch all expand from it. GGUF types without a kernel have no
    member; the builder dequantizes them to fp32.
    """

    _value_: str
    layout: BlockLayout | None  # None for fp32

    def __new__(cls, value: str, layout: BlockLayout | None = None) -> WeightFormat:
        member = str.__new__(cls, value)
        member._value_ = value
        member.layout = layout
        return member

    Q4_0 = "q4_0", BlockLayout(18, BLOCK_SIZE, quantizable=True)
    Q4_1 = "q4_1", BlockLayout(20, BLOCK_SIZE, quantizable=True)
    Q8_0 = "q8_0", BlockLayout(34, BLOCK_SIZE, quantizable=True)
    Q5_0 = "q5_0", BlockLayout(22, BLOCK_SIZE)
    Q5_1 = "q5_1", BlockLayout(24, BLOCK_SIZE)
    Q4_K = "q4_k", BlockLayout(144, SUPER_BLOCK)
    Q5_K = "q5_k", BlockLayout(176, SUPER_BLOCK)
    Q6_K = "q6_k", BlockLayout(210, SUPER_BLOCK)
    # gpt-oss's experts: not a `--weights` choice (its files and checkpoints bring them as MXFP4
    # already); `quantize_mxfp4` writes it for tests and converters
    MXFP4 = "mxfp4", BlockLayout(17, BLOCK_SIZE)
    FP32 = "fp32"

    @property
    def is_block(self) -> bool:
        return self.layout is not None

    @property
    def quantizable(self) -> bool:
        """Whether `quantize` writes this format from fp32 weights (a `--weights` choice)."""
        return self.layout is not None and self.layout.quantizable


class WeightCompute(str, Enum):
    """How block-quantized layers multiply (`ifb build --compute`).

    fp32: fp32 activations times the exact dequantized weights (the engine's numbers equal the
    fp32 engine's up to summation order). int8: the matmul quantizes its fp32 input rows per row
    and 32-block to int8 and takes integer dot products (llama.cpp's Q8_1 pairing); what
    `--compute auto`, the default, picks for block weights on every ISA with a kernel path (AVX2,
    AVX-512, AVX-512 VNNI: measured faster on each); its quality cost measured in bench/quality.py.
    """

    FP32 = "fp32"
    INT8 = "int8"


def _layout(fmt: WeightFormat) -> BlockLayout:
    if fmt.layout is None:
        raise ValueError(f"{fmt.value} is not a block format")
    return fmt.layout


# The block formats in the enum's order, which is the kernels' (Format's enumerators).
BLOCK_FORMATS: tuple[WeightFormat, ...] = tuple(fmt for fmt in WeightFormat if fmt.is_block)
# What `quantize` writes (the `--weights` block choices), largest blocks (most precise) first.
QUANTIZE_FORMATS: tuple[WeightFormat, ...] = tuple(
    sorted((fmt for fmt in BLOCK_FORMATS if fmt.quantizable), key=lambda fmt: -_layout(fmt).bytes)
)

# GGUF tensor type name -> our format: the block types the kernels read as they are stored.
GGUF_TYPE_NAMES: dict[str, WeightFormat] = {fmt.name: fmt for fmt in BLOCK_FORMATS}


def block_bytes(fmt: WeightFormat) -> int:
    """Bytes of one block of `fmt` (22 for Q5_0, 144 for a Q4_K super-block, ...)."""
    return _layout(fmt).bytes


def block_weights(fmt: WeightFormat) -> int:
    """Weights per block of `fmt` along K: 32, or 256 for the K-quants."""
    return _layout(fmt).weights


def kernel_format_table() -> str:
    """plugins/csrc/block_format_table.h: the block formats as an X-macro the C++ side expands."""
    rows = [f'X({fmt.name}, "{fmt.value}", {block_bytes(fmt)}, {block_weights(fmt)})' for fmt in BLOCK_FORMATS]
    lines = ["#define IFB_BLOCK_FORMATS(X)", *(f"  {row}" for row in rows)]
    width = max(len(line) for line in lines[:-1])
    body = "\n".join([*(line.ljust(width) + " \\" for line in lines[:-1]), lines[-1]])
    return (
        "// Generated from plugins/quant_formats.py's WeightFormat by `python -m ifb.plugins.quant_formats`:\n"
        "// do not edit (tests/unit/test_weight_formats.py fails when it differs from the enum).\n"
        "//\n"
        "// X(id, name, block bytes, weights per block) for each block format, in the enum's order. The\n"
        "// name is the enum's value: what engine.json records and the ifb_quant ops' `format` takes.\n"
        "#pragma once\n"
        "\n"
        f"{body}\n"
    )


def _halves(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at `offset` of each block, as fp32 [num_blocks, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 16] bytes -> [num_blocks, 32] values: low nibbles first, then high."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes [B, 12] -> 6-bit (scales, mins) [B, 8] as int32 (ggml's get_scale_min_k4)."""
    s = scales.to(torch.int32)
    low, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([low & 63, (top & 15) | ((low >> 6) << 4)], dim=1)
    mins = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=1)
    return sc, mins


def k_quant_values(flat: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """The integer quant of each weight of K-quant super-blocks [B, bytes] -> [B, 256] uint8
    (Q6_K: 0..63, before the -32). uint8 throughout: packing a model runs this over every weight,
    and int32 intermediates made it 4x the memory traffic (Q6_K packed at ~7 MB/s)."""
    if fmt is WeightFormat.Q6_K:
        ql = flat[:, :128].reshape(-1, 2, 64)
        qh = flat[:, 128:192].reshape(-1, 2, 1, 32)
        low = torch.cat([ql & 15, ql >> 4], dim=2)  # [B, half, 128]: weights 0..63 low, 64..127 high nibbles
        high = (qh >> _shifts(0, 2, 4, 6).reshape(1, 1, 4, 1)) & 3  # [B, half, 4, 32]
        return (low | (high.reshape(-1, 2, 128) << 4)).reshape(-1, SUPER_BLOCK)
    qs = flat[:, -128:].reshape(-1, 4, 32)
    values = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, SUPER_BLOCK)  # chunk c: sub-blocks 2c, 2c+1
    if fmt is WeightFormat.Q5_K:
        qh = flat[:, 16:48].reshape(-1, 1, 32)
        values = values | (((qh >> _shifts(*range(8)).reshape(1, 8, 1)) & 1) << 4).reshape(-1, SUPER_BLOCK)
    return values


def _shifts(*counts: int) -> torch.Tensor:
    """Shift counts as uint8, so shifting uint8 bytes by them stays uint8 (no int64 promotion)."""
    return torch.tensor(counts, dtype=torch.uint8)


def legacy_high_bits(flat: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5_0/Q5_1: the uint32 qh at `offset` -> each weight's 5th bit, [B, 32] uint8 times 16."""
    qh = flat[:, offset : offset + 4]
    bits = (qh[:, :, None] >> _shifts(*range(8)).reshape(1, 1, 8)) & 1  # byte r bit t = weight 8r + t
    return bits.reshape(-1, BLOCK_SIZE) << 4


def dequantize(blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """uint8 [N, K/block_weights * block_bytes] -> fp32 [N, K], bit-equal to gguf.quants.dequantize."""
    size, weights_per_block = block_bytes(fmt), block_weights(fmt)
    rows = blocks.shape[0]
    flat = blocks.reshape(-1, size)
    if fmt in (WeightFormat.Q4_K, WeightFormat.Q5_K):
        sc, mins = _k_scales(flat[:, 4:16])
        d_sc = _halves(flat, 0) * sc.to(torch.float32)  # numpy rounds d * sc, dmin * m, (d*sc) * q, then -
        d_min = _halves(flat, 2) * mins.to(torch.float32)
        q = k_quant_values(flat, fmt).to(torch.float32).reshape(-1, 8, BLOCK_SIZE)
        weights = d_sc[..., None] * q - d_min[..., None]
    elif fmt is WeightFormat.Q6_K:
        d_sc = _halves(flat, 208) * flat[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
        q = (k_quant_values(flat, fmt).to(torch.int32) - 32).to(torch.float32).reshape(-1, 16, 16)
        weights = d_sc[..., None] * q
    elif fmt is WeightFormat.Q5_0:
        q = ((_nibbles(flat[:, 6:]).to(torch.int32) | legacy_high_bits(flat, 2)) - 16).to(torch.float32)
        weights = _halves(flat, 0) * q
    elif fmt is WeightFormat.Q5_1:
        q = (_nibbles(flat[:, 8:]).to(torch.int32) | legacy_high_bits(flat, 4)).to(torch.float32)
        weights = (_halves(flat, 0) * q) + _halves(flat, 2)
    elif fmt is WeightFormat.Q4_0:
        q = (_nibbles(flat[:, 2:]).to(torch.int8) - 8).to(torch.float32)
        weights = _halves(flat, 0) * q
    elif fmt is WeightFormat.MXFP4:
        values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)[_nibbles(flat[:, 1:]).to(torch.int64)]
        weights = e8m0_half(flat[:, :1]) * values  # exact: a power of two times |v| <= 12 (or inf)
    elif fmt is WeightFormat.Q4_1:
        weights = (_halves(flat, 0) * _nibbles(flat[:, 4:]).to(torch.float32)) + _halves(flat, 2)  # two roundings
    else:
        weights = flat[:, 2:].contiguous().view(torch.int8).to(torch.float32) * _halves(flat, 0)
    assert weights.numel() == flat.shape[0] * weights_per_block
    return weights.reshape(rows, -1)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 scales -> fp32 2^(e-128), half the scale (ggml's ggml_e8m0_to_fp32_half), exactly:
    through the bits, subnormal for e < 2."""
    e32 = e.to(torch.int32)
    bits = torch.where(e32 < 2, torch.tensor(0x00200000, dtype=torch.int32) << e32, (e32 - 1) << 23)
    return bits.view(torch.float32)


# Blocks per MXFP4 quantizing chunk: the [blocks, 32, 16] candidate errors stay near 32 MB.
_MXFP4_CHUNK_BLOCKS = 1 << 14


def quantize_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] (K a multiple of 32) -> uint8 [N, K/32 * 17] MXFP4 blocks, gguf.quants.MXFP4's
    bytes: e = floor(log2 max|x|) - 2 + 127 (0 for an all-zero block), then each weight's code is
    the first of the 16 values v nearest to x by |(2^(e-128) v) - x| in fp32. log2 is numpy's
    float32 log2, gguf's own, since its rounding just below a power of two decides e. Below
    max|x| = 2^-125 the exponent is negative and wraps modulo 256 as gguf's uint8 cast does
    (ggml's C cast is undefined there): such a block's huge scale quantizes it to zeros."""
    rows, cols = weight.shape
    if cols % BLOCK_SIZE:
        raise ValueError(f"K must be a multiple of {BLOCK_SIZE} to quantize to mxfp4, got {cols}")
    blocks = weight.detach().to(torch.float32).reshape(-1, BLOCK_SIZE)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    out = torch.empty((blocks.shape[0], block_bytes(WeightFormat.MXFP4)), dtype=torch.uint8)
    for first in range(0, blocks.shape[0], _MXFP4_CHUNK_BLOCKS):
        chunk = blocks[first : first + _MXFP4_CHUNK_BLOCKS]
        peak = chunk.abs().amax(dim=1, keepdim=True).numpy()
        with np.errstate(divide="ignore"):
            exponent = np.where(peak > 0, np.floor(np.log2(peak)) - 2 + 127, 0)
        e = torch.from_numpy(exponent).to(torch.int32).bitwise_and(0xFF).to(torch.uint8)  # gguf's wrap
        errors = (e8m0_half(e)[:, :, None] * values - chunk[:, :, None]).abs()  # [blocks, 32, 16]
        codes = errors.argmin(dim=-1).to(torch.uint8)  # the first of equal errors, as gguf and ggml
        out[first : first + chunk.shape[0]] = torch.cat([e, _pack_nibbles(codes)], dim=1)
    return out.reshape(rows, -1)


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
        *first, last = (f.name for f in BLOCK_FORMATS if f.quantizable)
        raise ValueError(
            f"quantize writes {', '.join(first)} and {last} only (GGUF files bring the others), got {fmt.value}"
        )
    return torch.cat(fields, dim=1).reshape(rows, -1)


if __name__ == "__main__":  # regenerate the kernels' table after changing WeightFormat
    table = Path(__file__).parent / "csrc" / "block_format_table.h"
    table.write_text(kernel_format_table())
    print(f"wrote {table}")
