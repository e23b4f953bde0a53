"""The `--compute int8` kernel: int8 activations x GGUF blocks with integer dot products.

Pins: the result is within fp32 rounding of a float64 product of the quantized activations and
the exact weights (so the packing and the integer arithmetic are right for every format and odd
shape); a row's bits do not depend on M, its position or the thread count; the AVX2 and the
AVX-512-without-VNNI builds (maddubs) give the VNNI build's exact bits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kernel_builds import KernelBuilds
from other_isa import other_isa_build, run_in_build
from quant_cases import random_blocks, random_x

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import (
    QuantIsa,
    QuantLibrary,
    one_row_tiles,
    set_one_row_tiles,
    wide_one_row_tiles,
)
from ifb.plugins.quant_formats import BLOCK_SIZE, WeightFormat, dequantize, quantize

FORMATS = [WeightFormat.Q4_0, WeightFormat.Q4_1, WeightFormat.Q8_0]


def int8_matmul(x: torch.Tensor, blocks: torch.Tensor, fmt: WeightFormat, threads: int = 2) -> torch.Tensor:
    n, k = blocks.shape[0], x.shape[-1]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return quant_ops.quant_linear_int8(x, quant_ops.pack_int8(blocks, fmt, n, k), fmt, n, k)
    finally:
        torch.set_num_threads(before)


def test_activation_quantization_round_trips_within_half_a_step() -> None:
    """q * d is within d/2 of x, the block's peak maps to +-127, an all-zero block stays zero."""
    x = random_x(3, 96, seed=1)
    x[1, 32:64] = 0.0
    q, d = quant_ops.quantize_activations(x)
    blocks = x.reshape(3, -1, BLOCK_SIZE)
    restored = q.to(torch.float32).reshape(3, -1, BLOCK_SIZE) * d[..., None]
    assert bool(((restored - blocks).abs() <= d[..., None] / 2 + 1e-7).all())
    assert bool((q.reshape(3, -1, BLOCK_SIZE).abs().amax(-1)[d > 0] == 127).all())
    assert d[1, 1] == 0 and not q.reshape(3, -1, BLOCK_SIZE)[1, 1].any()


def identity_q8_0(k: int) -> torch.Tensor:
    """Q8_0 blocks of the k x k identity: row n holds d = 1 and quant 1 at column n, zeros elsewhere."""
    blocks = torch.zeros(k, k // BLOCK_SIZE, 2 + BLOCK_SIZE, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for n in range(k):
        blocks[n, n // BLOCK_SIZE, :2] = one
        blocks[n, n // BLOCK_SIZE, 2 + n % BLOCK_SIZE] = 1
    return blocks.reshape(k, -1)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_quantizes_activations_bit_for_bit_as_the_reference(quant_library: QuantLibrary, threads: int) -> None:
    """Through identity weights each output is one rounding of q * d: the kernel's own int8 values
    and scales, which must equal quantize_activations' (ties round half to even, zero blocks stay 0)."""
    k = 96
    x = random_x(37, k, seed=5)
    x[1, 32:64] = 0.0
    x[2, :BLOCK_SIZE] = torch.arange(BLOCK_SIZE) - 15.5  # peak 16.5 -> ties at every other value
    x[3, :BLOCK_SIZE] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * 26)  # d = 1: ties
    y = int8_matmul(x, identity_q8_0(k), WeightFormat.Q8_0, threads)
    q, d = quant_ops.quantize_activations(x)
    expected = (q.to(torch.float32).reshape(37, -1, BLOCK_SIZE) * d[..., None]).reshape(37, k)
    assert torch.equal(y, expected)
    assert y[3, 1] == 2.0 and y[3, 2] == -4.0 and y[3, 3] == 0.0  # half to even


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (17, 96), (40, 608), (100, 64)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 13, 64])
def test_matmul_matches_the_quantized_reference(
    quant_library: QuantLibrary, fmt: WeightFormat, n: int, k: int, m: int
) -> None:
    blocks = random_blocks(n, k, fmt, seed=n + k)
    x = random_x(m, k, seed=m)
    x[0, :BLOCK_SIZE] = 0.0  # a zero activation block (d = 0)
    y = int8_matmul(x, blocks, fmt)
    reference = quant_ops.reference_matmul_int8(x, blocks, fmt)
    q, d = quant_ops.quantize_activations(x)
    x_hat = (q.to(torch.float64).reshape(m, -1, BLOCK_SIZE) * d.to(torch.float64)[..., None]).reshape(m, k)
    # Per block: one rounding of d_w * d_x, one of the fma (two for Q4_1); the integer dot is exact.
    bound = 4 * (k // BLOCK_SIZE + 2) * 2.0**-24 * (x_hat.abs() @ dequantize(blocks, fmt).abs().to(torch.float64).T)
    error = (y.to(torch.float64) - reference).abs()
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert bool((error <= bound + 1e-30).all()), f"max error {error.max().item():.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_is_close_to_the_exact_product(quant_library: QuantLibrary, fmt: WeightFormat) -> None:
    """Quantizing activations to int8 per 32-block costs well under 1% relative error here."""
    n, k = 64, 576
    weights = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05
    blocks = quantize(weights, fmt)
    x = random_x(8, k, seed=4)
    y = int8_matmul(x, blocks, fmt).to(torch.float64)
    exact = quant_ops.reference_matmul(x, blocks, fmt)
    assert (y - exact).norm() / exact.norm() < 0.01


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_batch_invariant(quant_library: QuantLibrary, fmt: WeightFormat, threads: int) -> None:
    """Row i of matmul(X[s:s+M]) equals matmul(X[i:i+1]) bit for bit, M = 1..40, 64, 65 and 100
    (split into two row halves across threads), offsets 0 and 3."""
    n, k = 72, 160  # 4.5 tiles: full and partial tile groups, a partial tile
    blocks = random_blocks(n, k, fmt, seed=6)
    x = random_x(103, k, seed=7)
    singles = torch.cat([int8_matmul(x[i : i + 1], blocks, fmt, threads) for i in range(103)])
    for m in [*range(1, 41), 64, 65, 100]:
        for start in (0, 3):
            assert torch.equal(int8_matmul(x[start : start + m], blocks, fmt, threads), singles[start : start + m]), (
                f"M={m} offset={start}"
            )


@pytest.mark.parametrize("fmt", FORMATS)
def test_thread_count_does_not_change_bits(quant_library: QuantLibrary, fmt: WeightFormat) -> None:
    n, k = 1000, 96
    blocks = random_blocks(n, k, fmt, seed=8)
    for m in (1, 3, 8, 33):
        x = random_x(m, k, seed=m)
        assert torch.equal(int8_matmul(x, blocks, fmt, 1), int8_matmul(x, blocks, fmt, 2))


@pytest.fixture
def one_row_library(quant_library: QuantLibrary) -> Iterator[QuantLibrary]:
    """The kernel library, its one-row tile count given back to the CPU's choice afterwards."""
    yield quant_library
    set_one_row_tiles(quant_library.path, None)


def cpu_vendor() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


@pytest.mark.parametrize("fmt", [*FORMATS, WeightFormat.Q5_0, WeightFormat.Q4_K, WeightFormat.Q6_K, WeightFormat.MXFP4])
def test_one_row_tile_count_does_not_change_bits(one_row_library: QuantLibrary, fmt: WeightFormat) -> None:
    """A one-row pass streams one tile or several at once, as the CPU reads faster (the library's
    choice, or set): the same bits either way, with and without a remainder of single tiles."""
    path = one_row_library.path
    wide = wide_one_row_tiles(path)
    assert wide in (2, 4)
    k = 512
    for n in (16, 16 * 7 - 3, 16 * 9):
        blocks = random_blocks(n, k, fmt, seed=n)
        x = random_x(1, k, seed=n + 1)
        results = []
        for tiles in (1, wide):
            set_one_row_tiles(path, tiles)
            assert one_row_tiles(path) == tiles
            results.append(int8_matmul(x, blocks, fmt))
        assert torch.equal(results[0], results[1]), f"N={n}"
        assert torch.equal(results[0], int8_matmul(torch.cat([x, x]), blocks, fmt)[:1]), f"N={n}: the 2-row block"


def test_one_row_tile_count_is_the_cpus_unless_set(one_row_library: QuantLibrary) -> None:
    """One tile at a time on AMD CPUs (measured faster on an EPYC), the wide count elsewhere (on an
    Intel Xeon); anything but 1, the wide count or None is refused by name."""
    path = one_row_library.path
    wide = wide_one_row_tiles(path)
    set_one_row_tiles(path, 1)
    set_one_row_tiles(path, None)
    assert one_row_tiles(path) == (1 if cpu_vendor() == "AuthenticAMD" else wide)
    with pytest.raises(ValueError, match=f"one-row tiles must be 1 or {wide}"):
        set_one_row_tiles(path, 3)
    assert one_row_tiles(path) == (1 if cpu_vendor() == "AuthenticAMD" else wide)


_PRODUCTS = """
out = [quant_ops.quant_linear_int8(x, p, WeightFormat(f), n, x.shape[1]) for x, p, f, n in cases]
"""


@pytest.mark.parametrize("isa", [QuantIsa.AVX2, QuantIsa.AVX512])
def test_other_isa_builds_give_the_same_bits(
    quant_library: QuantLibrary, kernel_builds: KernelBuilds, tmp_path: Path, isa: QuantIsa
) -> None:
    """maddubs (AVX2, AVX-512 without VNNI) and vpdpbusd form the same exact integers."""
    other = other_isa_build(kernel_builds, isa)
    cases = []
    for index, fmt in enumerate(FORMATS):
        n, k = 45, 96
        packed = quant_ops.pack_int8(random_blocks(n, k, fmt, seed=9 + index), fmt, n, k)
        cases += [(random_x(m, k, seed=m), packed, fmt.value, n) for m in (1, 3, 7, 20)]
    for (x, packed, fmt, n), y in zip(cases, run_in_build(other, _PRODUCTS, cases, tmp_path), strict=True):
        assert torch.equal(y, quant_ops.quant_linear_int8(x, packed, WeightFormat(fmt), n, x.shape[1]))
