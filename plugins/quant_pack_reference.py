"""The tile packer as first written (torch, per weight): the reference `quant_pack` must equal.

`pack_reference(blocks, fmt, n, k, int8_layout)` spells the layouts of `quant_ops`'s docstring out
weight by weight (each quant unpacked to a byte, then its bits placed), so it reads as the layout's
definition; it packed at 6-50 MB/s, so builds use `quant_pack.pack_tiles`, which moves the same
bits in whole words and is tested byte for byte against this (tests/unit/test_quant_pack.py).
"""

from __future__ import annotations

import torch

from ifb.plugins.quant_formats import (
    BLOCK_SIZE,
    SUPER_BLOCK,
    WeightFormat,
    block_bytes,
    block_weights,
    k_quant_values,
    legacy_high_bits,
)
from ifb.plugins.quant_pack import TILE_COLUMNS, num_tiles


def _quant_values(flat: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """GGUF blocks [B, bytes] of a nibble format -> each weight's unsigned quant [B, weights] uint8."""
    if block_weights(fmt) == SUPER_BLOCK:
        return k_quant_values(flat, fmt)
    nibble_at = {
        WeightFormat.Q4_0: 2,
        WeightFormat.Q4_1: 4,
        WeightFormat.Q5_0: 6,
        WeightFormat.Q5_1: 8,
        WeightFormat.MXFP4: 1,
    }[fmt]
    values = torch.cat([flat[:, nibble_at:] & 0x0F, flat[:, nibble_at:] >> 4], dim=-1)
    if fmt in (WeightFormat.Q5_0, WeightFormat.Q5_1):
        values = values | legacy_high_bits(flat, nibble_at - 4)
    return values


def _pack_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 fields of `width` bits along the last dim (first field lowest) -> one uint8 per group."""
    total = bits[..., 0].clone()
    for j in range(1, bits.shape[-1]):
        total |= bits[..., j] << (width * j)
    return total


def high_bits(fmt: WeightFormat) -> int:
    """Bits of each quant above its nibble (stored apart): 1 for Q5_x, 2 for Q6_K."""
    return {WeightFormat.Q5_0: 1, WeightFormat.Q5_1: 1, WeightFormat.Q5_K: 1, WeightFormat.Q6_K: 2}.get(fmt, 0)


def _scale_fields(blocks: torch.Tensor, fmt: WeightFormat) -> list[torch.Tensor]:
    """The per-block scalars of [.., 16 cols, bytes] blocks, each transposed to one row of 16 columns."""
    if fmt is WeightFormat.MXFP4:  # its e8m0 byte: [16 cols]
        return [blocks[..., 0]]
    fp16_at = {
        WeightFormat.Q4_1: (0, 2),
        WeightFormat.Q5_1: (0, 2),
        WeightFormat.Q4_K: (0, 2),
        WeightFormat.Q5_K: (0, 2),
        WeightFormat.Q6_K: (208,),
    }.get(fmt, (0,))
    fields = [blocks[..., at : at + 2].flatten(-2) for at in fp16_at]
    if fmt in (WeightFormat.Q4_K, WeightFormat.Q5_K):
        fields.append(blocks[..., 4:16].transpose(-1, -2).flatten(-2))  # [12 bytes][16 cols]
    elif fmt is WeightFormat.Q6_K:
        fields.append(blocks[..., 192:208].transpose(-1, -2).flatten(-2))  # [16 scales][16 cols]
    return fields


def _tile_block_fields(blocks: torch.Tensor, fmt: WeightFormat, int8_layout: bool) -> torch.Tensor:
    """[T, nb, 16 cols, block_bytes] GGUF blocks -> [T, nb, 16 * block_bytes] tile-blocks (see `pack`)."""
    lead, size = blocks.shape[:-2], blocks.shape[-1]
    flat = blocks.reshape(-1, TILE_COLUMNS, size)  # [B, col, bytes]
    num = flat.shape[0]
    fields = [field.reshape(num, -1) for field in _scale_fields(flat, fmt)]
    if fmt is WeightFormat.Q8_0:
        quants = flat[..., 2:]
        if int8_layout:  # [B, col, g, b] -> [B, g, col, b]
            fields.append(quants.reshape(num, TILE_COLUMNS, 8, 4).transpose(1, 2).reshape(num, -1))
        else:  # [B, k, col]
            fields.append(quants.transpose(1, 2).reshape(num, -1))
        return torch.cat(fields, dim=-1).reshape(*lead, -1)
    subs = block_weights(fmt) // BLOCK_SIZE
    q = _quant_values(flat.reshape(-1, size), fmt).reshape(num, TILE_COLUMNS, subs, BLOCK_SIZE)
    low, high = q & 15, q >> 4
    if int8_layout:
        # byte b of column lane, group g: weight 8g + b (low nibble), 8g + 4 + b (high) -> [B, sub, g, col, b]
        halves = low.reshape(num, TILE_COLUMNS, subs, 4, 2, 4).transpose(-1, -2)  # [.., g, b, half]
        quants = _pack_bits(halves, 4).permute(0, 2, 3, 1, 4)
    else:
        # row i, column byte: weights 2i (low nibble), 2i + 1 (high) -> [B, sub, i, col]
        quants = _pack_bits(low.reshape(num, TILE_COLUMNS, subs, 16, 2), 4).permute(0, 2, 3, 1)
    bits = high_bits(fmt)
    if bits == 0:
        fields.append(quants.reshape(num, -1))
        return torch.cat(fields, dim=-1).reshape(*lead, -1)
    if bits == 1 and not int8_layout:  # a uint32 per column: bit e = weight e's 5th bit -> [B, sub, col, byte]
        extra = _pack_bits(high.reshape(num, TILE_COLUMNS, subs, 4, 8), 1).transpose(1, 2)
    elif bits == 1:  # byte b of a column: bit g = weight 8g + b, bit 4 + g = weight 8g + 4 + b
        pieces = high.reshape(num, TILE_COLUMNS, subs, 4, 2, 4).permute(0, 1, 2, 5, 4, 3).flatten(-2)  # [.., b, 4h+g]
        extra = _pack_bits(pieces, 1).transpose(1, 2)
    elif bits == 2 and not int8_layout:  # rows h of a uint32 per column, bits 2e' = weight 16h + e'
        # -> [B, sub, h, col, byte]
        pieces = high.reshape(num, TILE_COLUMNS, subs, 2, 4, 4)  # [.., h, byte, t]: weight 16h + 4 byte + t
        extra = _pack_bits(pieces, 2).permute(0, 2, 3, 1, 4)
    elif bits == 2:  # vector v, byte b: weight 16v + 4p + b's 2 bits at bit (4, 6, 0, 2)[p] -> [B, sub, v, col, b]
        pieces = high.reshape(num, TILE_COLUMNS, subs, 2, 4, 4).transpose(-1, -2)  # [.., v, b, p]
        extra = _pack_bits(pieces[..., [2, 3, 0, 1]], 2).permute(0, 2, 3, 1, 4)
    # Each sub-block's high bits right before its nibbles: the kernel reads a tile front to back.
    fields.append(torch.cat([extra.reshape(num, subs, -1), quants.reshape(num, subs, -1)], dim=-1).reshape(num, -1))
    return torch.cat(fields, dim=-1).reshape(*lead, -1)


def _tiles(blocks: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """GGUF rows of blocks -> [tiles, nb, 16 cols, block_bytes], N padded with zero blocks."""
    size, weights = block_bytes(fmt), block_weights(fmt)
    num_blocks = k // weights
    if k % weights or blocks.shape != (n, num_blocks * size) or blocks.dtype != torch.uint8:
        raise ValueError(
            f"expected uint8 [{n}, {num_blocks * size}] {fmt.value} blocks with K a multiple of {weights}, "
            f"got {tuple(blocks.shape)} for K={k}"
        )
    tiles = num_tiles(n)
    padded = blocks.new_zeros((tiles * TILE_COLUMNS, num_blocks * size))
    padded[:n] = blocks
    return padded.reshape(tiles, TILE_COLUMNS, num_blocks, size).transpose(1, 2)


# Weights per packing chunk: the int32 per-weight intermediates stay near 64 MB, so packing a
# 128k-row head does not take gigabytes (tiles are independent, chunking changes no byte).
_PACK_CHUNK_WEIGHTS = 1 << 24


def _pack_tiles(blocks: torch.Tensor, fmt: WeightFormat, n: int, k: int, int8_layout: bool) -> torch.Tensor:
    tiles = _tiles(blocks, fmt, n, k)
    out = torch.empty((tiles.shape[0], tiles[0].numel()), dtype=torch.uint8)
    step = max(1, _PACK_CHUNK_WEIGHTS // (TILE_COLUMNS * k))
    for first in range(0, tiles.shape[0], step):
        chunk = tiles[first : first + step]
        out[first : first + step] = _tile_block_fields(chunk, fmt, int8_layout).reshape(chunk.shape[0], -1)
    return out


def pack_reference(blocks: torch.Tensor, fmt: WeightFormat, n: int, k: int, int8_layout: bool) -> torch.Tensor:
    """GGUF rows of blocks -> `quant_ops.pack`'s tiles (or `pack_int8`'s), weight by weight."""
    return _pack_tiles(blocks, fmt, n, k, int8_layout)
