"""GGUF rows of blocks -> the kernels' tiles (`quant_ops.pack` / `pack_int8`), whole words at a time.

The layouts are `quant_ops`'s docstring; `quant_pack_reference.pack_reference` spells them out weight
by weight and this module must equal it byte for byte (tests/unit/test_quant_pack.py). The file's
blocks already hold every bit the kernels read, so nothing is unpacked to one byte per weight: each
field is moved by one strided numpy copy from the blocks (the 16 columns of a tile interleaved),
and the only bytes computed are those whose bits move, in 8-byte words over a chunk's whole field:

  nibbles    the pair of weights a kernel byte holds sits in two source bytes' same-side nibbles:
             one SWAR step per word makes both sides' bytes at once (`_swap_index_bits` on `_PAIR_NIBBLES` for pack's
             [2i, 2i+1] pairs, `_LANE_NIBBLES` for pack_int8's [8g+b, 8g+4+b] lanes)
  high bits  Q5_K's [32 bytes x 8 sub-blocks] bit matrix and Q6_K's 2-bit fields are transposed
             by delta swaps (`_swap_index_bits`), and pack_int8's lanes reorder them the same way

Tiles are independent, so rows are packed in chunks of about `CHUNK_BYTES` of blocks: the
temporaries stay a few times that whatever the tensor's size (a 128k-row head included).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ifb.plugins.quant_formats import WeightFormat, block_bytes, block_weights

TILE_COLUMNS = 16
# Source bytes per chunk: small enough that a chunk's fields and temporaries (about 4x) stay in
# the last-level cache, large enough that numpy's ~25 calls a chunk cost little. On the 2-core AVX2
# EPYC (1B FFN shapes, 2 threads, MB per CPU-second): 256 KB Q6_K ~740, Q4_K ~1240 (int8 layout);
# 512 KB ~830 / ~1400; 1 and 2 MB no better.
CHUNK_BYTES = 1 << 19
_NIBBLE_BYTES = 16 * TILE_COLUMNS  # one 32-weight (sub-)block's nibbles for the 16 columns

# Offsets inside a GGUF block: fp16 scalars (adjacent; stored first, [16 cols] each), the byte field stored
# [bytes][16 cols] (K-quant scales), the quants, and the bits above the nibbles.
_FP16_AT = {
    WeightFormat.Q4_1: (0, 2),
    WeightFormat.Q5_1: (0, 2),
    WeightFormat.Q4_K: (0, 2),
    WeightFormat.Q5_K: (0, 2),
    WeightFormat.Q6_K: (208,),
    WeightFormat.MXFP4: (),  # its one scale is a byte, e8m0
}
_BYTE_FIELD = {
    WeightFormat.Q4_K: (4, 12),
    WeightFormat.Q5_K: (4, 12),
    WeightFormat.Q6_K: (192, 16),
    WeightFormat.MXFP4: (0, 1),
}
_QUANTS_AT = {
    WeightFormat.Q4_0: 2,
    WeightFormat.Q4_1: 4,
    WeightFormat.Q5_0: 6,
    WeightFormat.Q5_1: 8,
    WeightFormat.Q8_0: 2,
    WeightFormat.Q4_K: 16,
    WeightFormat.Q5_K: 48,
    WeightFormat.Q6_K: 0,
    WeightFormat.MXFP4: 1,
}
# Bytes per 32-weight sub-block stored before its nibbles, for the 16 columns.
_HIGH_BYTES = {WeightFormat.Q5_0: 64, WeightFormat.Q5_1: 64, WeightFormat.Q5_K: 64, WeightFormat.Q6_K: 128}


def num_tiles(n: int) -> int:
    return -(-n // TILE_COLUMNS)


def pack_tiles(
    blocks: torch.Tensor | Sequence[torch.Tensor],
    fmt: WeightFormat,
    n: int,
    k: int,
    int8_layout: bool,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
) -> torch.Tensor:
    """GGUF rows uint8 [n, k/block_weights * block_bytes] -> uint8 [ceil(n/16), k/block_weights * 16 *
    block_bytes] tiles: `pack`'s exact layout, or `pack_int8`'s with `int8_layout`.

    `blocks` may be the rows in parts (a fused module's q, k, v as the file holds them): packed as
    their concatenation without making it. Chunks of about `chunk_bytes` of blocks are packed by
    `workers` threads (default: torch's intra-op threads)."""
    chunks = _Chunks.of(blocks, fmt, n, k, int8_layout, chunk_bytes, workers)
    out = np.empty((chunks.tiles, chunks.tile_bytes), dtype=np.uint8)
    chunks.run(lambda first, count: chunks.pack(first, out[first : first + count]))
    return torch.from_numpy(out)


def pack_tiles_into(
    blocks: torch.Tensor | Sequence[torch.Tensor],
    fmt: WeightFormat,
    n: int,
    k: int,
    int8_layout: bool,
    write: Callable[[int, np.ndarray], None],
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
) -> int:
    """`pack_tiles`'s bytes handed to `write(byte offset, uint8 bytes)` a chunk of tiles at a time,
    from `workers` threads side by side, and the number of bytes: the tiles never exist whole.

    Each thread packs into one buffer it reuses, so no fresh memory is touched. Why: on the 2-core
    EPYC VM, memory the process has not touched lately costs ~3.7 s per GB to fault in (freed pages
    go back to the host) against 0.12 s warm, and a 1B Q4_K_M's tiles are 836 MB; packed into a
    whole tensor and then written they were paid for twice (the tensor, then the page cache)."""
    chunks = _Chunks.of(blocks, fmt, n, k, int8_layout, chunk_bytes, workers)
    buffers = threading.local()

    def pack_chunk(first: int, count: int) -> None:
        buffer = getattr(buffers, "tiles", None)
        if buffer is None:
            buffer = buffers.tiles = np.empty((chunks.step, chunks.tile_bytes), dtype=np.uint8)
        chunks.pack(first, buffer[:count])
        write(first * chunks.tile_bytes, buffer[:count].reshape(-1))

    chunks.run(pack_chunk)
    return chunks.tiles * chunks.tile_bytes


@dataclass(frozen=True, slots=True)
class _Chunks:
    """A tensor's tiles cut into chunks of `step` tiles (the last one shorter), packed independently
    by `workers` threads."""

    rows: _Rows
    fmt: WeightFormat
    int8_layout: bool
    tiles: int
    num_blocks: int
    step: int
    workers: int

    @staticmethod
    def of(
        blocks: torch.Tensor | Sequence[torch.Tensor],
        fmt: WeightFormat,
        n: int,
        k: int,
        int8_layout: bool,
        chunk_bytes: int,
        workers: int | None,
    ) -> _Chunks:
        size, weights = block_bytes(fmt), block_weights(fmt)
        num_blocks = k // weights
        parts = [blocks] if isinstance(blocks, torch.Tensor) else list(blocks)
        shapes = [tuple(part.shape) for part in parts]
        width = num_blocks * size
        if (
            k % weights
            or not parts
            or any(len(shape) != 2 or shape[1] != width for shape in shapes)
            or sum(shape[0] for shape in shapes) != n
            or any(part.dtype != torch.uint8 for part in parts)
        ):
            got = shapes[0] if isinstance(blocks, torch.Tensor) else shapes
            raise ValueError(
                f"expected uint8 [{n}, {width}] {fmt.value} blocks with K a multiple of {weights}, got {got} for K={k}"
            )
        if chunk_bytes < 1 or (workers is not None and workers < 1):
            raise ValueError(f"chunk_bytes and workers must be positive, got {chunk_bytes} and {workers}")
        rows = _Rows([part.detach().cpu().contiguous().numpy() for part in parts])
        step = max(1, chunk_bytes // max(1, TILE_COLUMNS * width))
        tiles = num_tiles(n)
        count = len(range(0, tiles, step))
        return _Chunks(rows, fmt, int8_layout, tiles, num_blocks, step, min(count, workers or torch.get_num_threads()))

    @property
    def tile_bytes(self) -> int:
        return self.num_blocks * TILE_COLUMNS * block_bytes(self.fmt)

    def pack(self, first: int, dst: np.ndarray) -> None:
        """Tiles first.. into dst uint8 [count, tile bytes]."""
        count, size = dst.shape[0], block_bytes(self.fmt)
        src = self.rows.take(first * TILE_COLUMNS, count * TILE_COLUMNS)
        tiles = np.reshape(dst, (count, self.num_blocks, TILE_COLUMNS * size), copy=False)
        _pack_chunk(src.reshape(count, TILE_COLUMNS, self.num_blocks, size), tiles, self.fmt, self.int8_layout)

    def run(self, pack_chunk: Callable[[int, int], None]) -> None:
        """pack_chunk(first tile, count) for every chunk."""
        firsts = range(0, self.tiles, self.step)

        def one(first: int) -> None:
            pack_chunk(first, min(self.tiles, first + self.step) - first)

        if self.workers <= 1:
            for first in firsts:
                one(first)
        else:  # numpy lets go of the GIL in its copies and bit operations: chunks pack side by side
            with ThreadPoolExecutor(self.workers) as pool:
                for _ in pool.map(one, firsts):  # re-raises a chunk's error
                    pass


class _Rows:
    """Row-wise parts read as one array: a chunk inside one part is a view of it, one across parts
    or past the end (zero blocks padding the last tile) a copy of at most a chunk."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.starts = np.cumsum([0] + [part.shape[0] for part in parts]).tolist()

    def take(self, first: int, count: int) -> np.ndarray:
        for index, part in enumerate(self.parts):
            start = self.starts[index]
            if start <= first and first + count <= start + part.shape[0]:
                return part[first - start : first - start + count]
        out = np.zeros((count, self.parts[0].shape[1]), dtype=np.uint8)
        for index, part in enumerate(self.parts):
            lo, hi = max(first, self.starts[index]), min(first + count, self.starts[index + 1])
            if lo < hi:
                out[lo - first : hi - first] = part[lo - self.starts[index] : hi - self.starts[index]]
        return out


def _into(region: np.ndarray, shape: tuple[int, ...], values: np.ndarray) -> None:
    """Write `values` through `region` seen as `shape` (a view: np.reshape refuses to copy)."""
    np.reshape(region, shape, copy=False)[...] = values


def _pack_chunk(src: np.ndarray, dst: np.ndarray, fmt: WeightFormat, int8_layout: bool) -> None:
    """src [T, col, nb, block bytes] (a view of the rows) -> dst [T, nb, 16 * block bytes]."""
    tiles, _, num_blocks, _ = src.shape
    lead = (tiles, num_blocks)
    # fp16 fields [16 cols] each, moved as 16-bit words (every format with one has even block sizes
    # and offsets; MXFP4, 17 bytes, has none)
    fp16_at = _FP16_AT.get(fmt, (0,))
    at = 32 * len(fp16_at)
    if fp16_at:
        first, count = fp16_at[0] // 2, len(fp16_at)
        fp16 = src.view(np.uint16)[..., first : first + count]  # [T, col, nb, field]
        _into(dst[:, :, :at].view(np.uint16), (*lead, count, TILE_COLUMNS), fp16.transpose(0, 2, 3, 1))
    if fmt in _BYTE_FIELD:
        offset, count = _BYTE_FIELD[fmt]
        field = src[..., offset : offset + count].transpose(0, 2, 3, 1)
        _into(dst[:, :, at : at + count * TILE_COLUMNS], (*lead, count, TILE_COLUMNS), field)
        at += count * TILE_COLUMNS
    body = dst[:, :, at:]
    quants_at = _QUANTS_AT[fmt]
    if fmt is WeightFormat.Q8_0:
        quants = src[..., quants_at : quants_at + 32]
        if int8_layout:  # [g, col, 4 bytes]
            _into(
                body,
                (*lead, 8, TILE_COLUMNS, 4),
                np.reshape(quants, (tiles, 16, num_blocks, 8, 4), copy=False).transpose(0, 2, 3, 1, 4),
            )
        else:  # [k, col]
            _into(body, (*lead, 32, TILE_COLUMNS), quants.transpose(0, 2, 3, 1))
        return
    subs = block_weights(fmt) // 32
    extra = _HIGH_BYTES.get(fmt, 0)
    per_sub = np.reshape(body, (*lead, subs, extra + _NIBBLE_BYTES), copy=False)
    _nibbles(src, per_sub[..., extra:], fmt, int8_layout)
    if extra:
        _high_bits(src, per_sub[..., :extra], fmt, int8_layout)


# The nibble moves are delta swaps of bit positions: position bit 2 (low/high nibble of a byte)
# exchanged with bit 3 (the next byte: pack's [2i, 2i+1] pairs) or bit 5 (the byte 4 later:
# pack_int8's [8g+b, 8g+4+b] lanes), so both sides' low nibbles land in one byte and high in the other.
_PAIR_NIBBLES = (2, 3)
_LANE_NIBBLES = (2, 5)


def _nibbles(src: np.ndarray, target: np.ndarray, fmt: WeightFormat, int8_layout: bool) -> None:
    """Each sub-block's nibbles into target [T, nb, subs, 256 bytes]: pack's [i][col] bytes (weights
    2i, 2i+1) or pack_int8's [g][col] 4-byte lanes (weights 8g+b, 8g+4+b)."""
    tiles, _, num_blocks, _ = src.shape
    lead = (tiles, num_blocks)
    at = _QUANTS_AT[fmt]
    span = 16 if block_weights(fmt) == 32 else 128
    words = np.ascontiguousarray(src[..., at : at + span]).view(np.uint64)
    if int8_layout:
        units = _swap_index_bits(words, *_LANE_NIBBLES).view(np.uint32)  # per 8 source bytes: (low, high) lanes
        per_run = 4  # units per 32 source bytes and side
        target = target.view(np.uint32)
    else:
        units = _swap_index_bits(words, *_PAIR_NIBBLES).view(np.uint8)  # per 2 source bytes: (low, high) bytes
        per_run = 16
    cols = TILE_COLUMNS
    if span == 16:  # legacy: weights 0..15 the low nibbles of 16 bytes, 16..31 the high ones
        # source [col, unit, side] -> one sub-block: [side, unit, col]
        units = units.reshape(tiles, cols, num_blocks, per_run // 2, 2)
        _into(target, (*lead, 2, per_run // 2, cols), units.transpose(0, 2, 4, 3, 1))
    elif fmt is WeightFormat.Q6_K:  # sub-block 4h + 2e + a: side e of ql's 32 bytes at 64h + 32a
        units = units.reshape(tiles, cols, num_blocks, 2, 2, per_run, 2)  # [col, h, a, unit, side e]
        _into(target, (*lead, 2, 2, 2, per_run, cols), units.transpose(0, 2, 3, 6, 4, 5, 1))
    else:  # Q4_K / Q5_K: sub-block 2c + e: side e of qs's 32 bytes at 32c
        units = units.reshape(tiles, cols, num_blocks, 4, per_run, 2)  # [col, c, unit, side e]
        _into(target, (*lead, 4, 2, per_run, cols), units.transpose(0, 2, 3, 5, 4, 1))


def _swap_index_bits(words: np.ndarray, low: int, high: int) -> np.ndarray:
    """Exchange the bits whose positions differ only in position bits `low` and `high` (a delta swap):
    the bit at position p moves to p with those two position bits exchanged."""
    delta = (1 << high) - (1 << low)
    mask = _swap_mask(words.itemsize * 8, low, high)
    moved = words >> delta
    moved ^= words
    moved &= mask
    out = words ^ moved
    moved <<= delta
    out ^= moved
    return out


@functools.cache
def _swap_mask(width: int, low: int, high: int) -> int:
    """The positions of a `width`-bit word with position bit `low` set and `high` clear."""
    return sum(1 << p for p in range(width) if (p >> low) & 1 and not (p >> high) & 1)


def _int8_lanes(exact: np.ndarray) -> np.ndarray:
    """uint32 words with bit e = weight e's 5th bit -> pack_int8's: byte b, bit g = weight 8g + b's,
    bit 4 + g = weight 8g + 4 + b's (positions 8g + 4h + b -> 8b + 4h + g)."""
    return _swap_index_bits(_swap_index_bits(exact, 0, 3), 1, 4)


def _transpose_pairs(words: np.ndarray) -> np.ndarray:
    """uint32 words as 4 bytes x 4 two-bit fields -> byte i field j <- byte j field i."""
    return _swap_index_bits(_swap_index_bits(words, 1, 3), 2, 4)


def _high_bits(src: np.ndarray, target: np.ndarray, fmt: WeightFormat, int8_layout: bool) -> None:
    """Each sub-block's bits above the nibbles into target [T, nb, subs, high bytes] (see quant_ops)."""
    tiles, cols, num_blocks, _ = src.shape
    lead = (tiles, num_blocks)
    if fmt in (WeightFormat.Q5_0, WeightFormat.Q5_1):
        at = 2 if fmt is WeightFormat.Q5_0 else 4
        qh = src[..., at : at + 4]  # a uint32 per column: bit e = weight e's 5th bit, as pack stores it
        if not int8_layout:
            _into(target, (*lead, cols, 4), qh.transpose(0, 2, 1, 3))
            return
        lanes = _int8_lanes(np.ascontiguousarray(qh).view(np.uint32)[..., 0])  # [T, col, nb]
        _into(target.view(np.uint32), (*lead, cols), lanes.transpose(0, 2, 1))
    elif fmt is WeightFormat.Q5_K:
        # qh[l] bit s = weight 32s + l's 5th bit; per 8 bytes l = 8q + j, transpose the 8x8 bit matrix
        # (position 8j + s -> 8s + j): byte s of word q = sub-block s's bits of weights 8q..8q+7
        words = np.ascontiguousarray(src[..., 16:48]).view(np.uint64)  # [T, col, nb, q]
        for low in range(3):
            words = _swap_index_bits(words, low, low + 3)
        by_sub = words.view(np.uint8).reshape(tiles, cols, num_blocks, 4, 8)  # [col, q, s]
        if not int8_layout:  # sub-block s: a uint32 per column whose byte q is word q's byte s
            _into(target, (*lead, 8, cols, 4), by_sub.transpose(0, 2, 4, 1, 3))
            return
        exact = np.ascontiguousarray(by_sub.transpose(0, 1, 2, 4, 3)).view(np.uint32)[..., 0]  # [T, col, nb, s]
        _into(target.view(np.uint32), (*lead, 8, cols), _int8_lanes(exact).transpose(0, 2, 3, 1))
    else:  # Q6_K: qh[32h + l] bits 2m = weight l of sub-block 4h + m
        # Per 16 bytes (h, v) as bit positions 32r + 8t + 2m (+ bit): weight 16v + 4r + t of sub-block
        # (h, m). pack's word for sub-block (h, m), row v is 32m + 8r + 2t: bytes r of fields t. So
        # exchange m with t (within each uint32), then m with r (3 <-> 5 inside each uint64, 4 <-> 6
        # across the two uint64 of the 16 bytes), and only whole words are copied into the tiles.
        fields: np.ndarray = np.ascontiguousarray(src[..., 128:192]).view(np.uint64)  # [T, col, nb, (h, v, half)]
        fields = (_q6_int8_high if int8_layout else _q6_high)(fields.reshape(tiles, cols, num_blocks, 2, 2, 2))
        by_word = fields.view(np.uint32).reshape(tiles, cols, num_blocks, 2, 2, 4)  # [T, col, nb, h, v, m]
        _into(target.view(np.uint32), (*lead, 2, 4, 2, cols), by_word.transpose(0, 2, 3, 5, 4, 1))


def _q6_high(fields: np.ndarray) -> np.ndarray:
    """Q6_K's qh as uint64 [..., 2 (the halves of 16 bytes)] -> pack's words: position bits
    1 <-> 3 and 2 <-> 4 (`_transpose_pairs`), 3 <-> 5, then 4 <-> 6 (across the halves)."""
    fields = _swap_index_bits(_transpose_pairs(fields), 3, 5)
    first, second = fields[..., 0], fields[..., 1]  # positions 0..63 and 64..127 of each 16 bytes
    moved = first >> 16
    moved ^= second
    moved &= 0x0000FFFF0000FFFF
    second ^= moved
    moved <<= 16
    first ^= moved
    return fields


def _q6_int8_high(fields: np.ndarray) -> np.ndarray:
    """Q6_K's qh as uint64 [..., 2] -> pack_int8's words. Its word (sub-block, v) has byte b field p ^ 2 =
    weight 16v + 4p + b: pack's word with bytes and fields exchanged (`_transpose_pairs` again), then
    each byte's nibbles swapped. Composed, those seven steps are position bits 1 <-> 5 and 2 <-> 6,
    then bit 2 flipped, done here in two (a 1B's FFN-shaped Q6_K, one thread, on the 2-core EPYC:
    610 -> 1260 MB/s)."""
    fields = _swap_index_bits(fields, 1, 5)
    first, second = fields[..., 0], fields[..., 1]
    low, high = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0xF0F0F0F0F0F0F0F0)
    out = np.empty_like(fields)
    # bits 2 <-> 6, then bit 2 flipped (each byte's nibbles swapped), per half and nibble:
    np.bitwise_and(second, low, out=out[..., 0])  # low nibbles <- the second half's low nibbles
    out[..., 0] |= (first << 4) & high  # high nibbles <- the first half's low nibbles
    np.right_shift(second, 4, out=out[..., 1])  # low nibbles <- the second half's high nibbles
    out[..., 1] &= low
    out[..., 1] |= first & high  # high nibbles <- the first half's high nibbles
    return out
