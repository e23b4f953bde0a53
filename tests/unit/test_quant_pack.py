"""The word-at-a-time tile packer (plugins/quant_pack.py) equals the weight-by-weight reference.

Pins: for every block format the kernels read and both layouts (`pack`'s exact, `pack_int8`'s), the
packed bytes are the reference's byte for byte — on seeded random bytes (every bit pattern of
every field, scales included: packing never reads a value), with N not a multiple of 16 (a padded
last tile), K of one and of several blocks, chunks of one tile and of many, one thread and several,
the rows whole or in parts (a fused module's);
`pack_tiles_into` hands out the same bytes chunk by chunk;
`quant_ops.pack` / `pack_int8` are that packer; a wrong shape is refused naming the expected one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ifb.plugins import quant_ops
from ifb.plugins.quant_formats import BLOCK_FORMATS, WeightFormat, block_bytes, block_weights
from ifb.plugins.quant_pack import pack_tiles, pack_tiles_into
from ifb.plugins.quant_pack_reference import pack_reference

LAYOUTS = {"exact": False, "int8": True}
# (n, blocks per row): one tile short of full, several tiles with a partial last one
SHAPES = [(9, 1), (16, 2), (53, 3)]


def _random_rows(n: int, fmt: WeightFormat, num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, num_blocks * block_bytes(fmt)), dtype=torch.uint8, generator=generator)


def _first_difference(new: torch.Tensor, old: torch.Tensor) -> str:
    diff = (new != old).nonzero()
    if diff.numel() == 0:
        return "none"
    tile, byte = diff[0].tolist()
    return f"{diff.shape[0]} bytes, first at tile {tile} byte {byte}: {new[tile, byte]} != {old[tile, byte]}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda fmt: fmt.value)
def test_packed_bytes_equal_the_reference(fmt: WeightFormat, layout: str) -> None:
    """Every format and layout: the same bytes as `pack_reference`, whatever the chunking and threads."""
    int8_layout = LAYOUTS[layout]
    for index, (n, num_blocks) in enumerate(SHAPES):
        k = num_blocks * block_weights(fmt)
        rows = _random_rows(n, fmt, num_blocks, seed=100 * index + len(fmt.value))
        expected = pack_reference(rows, fmt, n, k, int8_layout)
        tile_bytes = 16 * num_blocks * block_bytes(fmt)
        for chunk_bytes, workers in ((1, 1), (1, 3), (tile_bytes * 2, 2), (1 << 20, 1)):
            packed = pack_tiles(rows, fmt, n, k, int8_layout, chunk_bytes=chunk_bytes, workers=workers)
            assert packed.shape == expected.shape and packed.dtype == torch.uint8
            assert torch.equal(packed, expected), (
                f"{fmt.value} {layout} n={n} k={k} chunk={chunk_bytes} workers={workers}: "
                f"{_first_difference(packed, expected)}"
            )


@pytest.mark.parametrize("fmt", [WeightFormat.Q4_K, WeightFormat.Q6_K, WeightFormat.Q5_0], ids=lambda f: f.value)
def test_quant_ops_pack_is_the_fast_packer(fmt: WeightFormat) -> None:
    """The builder's packers (`quant_ops.pack`, `pack_int8`) give the reference's bytes."""
    n, num_blocks = 40, 2
    k = num_blocks * block_weights(fmt)
    rows = _random_rows(n, fmt, num_blocks, seed=7)
    assert torch.equal(quant_ops.pack(rows, fmt, n, k), pack_reference(rows, fmt, n, k, False))
    assert torch.equal(quant_ops.pack_int8(rows, fmt, n, k), pack_reference(rows, fmt, n, k, True))


@pytest.mark.parametrize("fmt", [WeightFormat.Q4_K, WeightFormat.Q6_K, WeightFormat.Q8_0], ids=lambda f: f.value)
def test_row_parts_pack_as_their_concatenation(fmt: WeightFormat) -> None:
    """A fused module's parts (q 24 rows, k 5, v 19: tiles straddle parts) give the bytes of the rows
    concatenated, one tile per chunk (chunks straddling parts) or all in one."""
    num_blocks = 2
    k = num_blocks * block_weights(fmt)
    parts = [_random_rows(n, fmt, num_blocks, seed=20 + n) for n in (24, 5, 19)]
    whole = torch.cat(parts)
    for int8_layout in LAYOUTS.values():
        expected = pack_reference(whole, fmt, whole.shape[0], k, int8_layout)
        for chunk_bytes in (1, 1 << 20):
            packed = pack_tiles(parts, fmt, whole.shape[0], k, int8_layout, chunk_bytes=chunk_bytes)
            assert torch.equal(packed, expected), _first_difference(packed, expected)


def test_a_wrong_shape_is_refused_naming_the_expected_one() -> None:
    rows = torch.zeros((16, 143), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"expected uint8 \[16, 144\] q4_k blocks"):
        pack_tiles(rows, WeightFormat.Q4_K, 16, 256, int8_layout=False)
    with pytest.raises(ValueError, match="chunk_bytes and workers must be positive"):
        pack_tiles(torch.zeros((16, 144), dtype=torch.uint8), WeightFormat.Q4_K, 16, 256, False, workers=0)
    parts = [torch.zeros((8, 144), dtype=torch.uint8), torch.zeros((7, 144), dtype=torch.uint8)]
    with pytest.raises(ValueError, match=r"expected uint8 \[16, 144\] q4_k blocks .* got \[\(8, 144\), \(7, 144\)\]"):
        pack_tiles(parts, WeightFormat.Q4_K, 16, 256, int8_layout=False)


@pytest.mark.parametrize("fmt", [WeightFormat.Q4_K, WeightFormat.Q6_K, WeightFormat.Q5_0], ids=lambda f: f.value)
def test_tiles_handed_out_in_chunks_are_pack_tiles_bytes(fmt: WeightFormat) -> None:
    """`pack_tiles_into` (the build's writer path) hands out every byte of `pack_tiles` exactly once,
    at its offset, whatever the chunking and threads, rows whole or in parts."""
    num_blocks = 2
    k = num_blocks * block_weights(fmt)
    parts = [_random_rows(n, fmt, num_blocks, seed=40 + n) for n in (24, 5, 19)]
    n = sum(part.shape[0] for part in parts)
    tile_bytes = 16 * num_blocks * block_bytes(fmt)
    for int8_layout in LAYOUTS.values():
        expected = pack_tiles(parts, fmt, n, k, int8_layout).reshape(-1).numpy()
        for chunk_bytes, workers in ((1, 1), (1, 3), (tile_bytes * 2, 2), (1 << 20, 1)):
            got = np.zeros_like(expected)
            times = np.zeros(expected.size, dtype=np.int64)

            def write(offset: int, tiles: np.ndarray, got: np.ndarray = got, times: np.ndarray = times) -> None:
                got[offset : offset + tiles.size] = tiles
                times[offset : offset + tiles.size] += 1

            size = pack_tiles_into(parts, fmt, n, k, int8_layout, write, chunk_bytes=chunk_bytes, workers=workers)
            assert size == expected.size and (times == 1).all(), (chunk_bytes, workers)
            assert np.array_equal(got, expected), (fmt.value, int8_layout, chunk_bytes, workers)
