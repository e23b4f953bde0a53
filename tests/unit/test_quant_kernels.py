"""Block-quantized matmul kernels vs the pure-torch reference and the gguf package.

Pins: the reference dequantize/quantize are gguf's bits; the kernel dequantizes to those exact
bits; the matmul is within fp32 rounding of a float64 reference for every format and odd shape;
a row's output is bitwise independent of M, of its position, and of the thread count; the AVX2
build gives the AVX-512 build's exact bits; a CPU lacking a feature is refused in one line.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kernel_builds import KernelBuilds
from other_isa import run_in_build
from quant_cases import random_blocks, random_x

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import (
    QuantIsa,
    QuantLibrary,
    QuantLibraryError,
    cpu_features,
    load_quant_library,
)
from ifb.plugins.quant_formats import BLOCK_FORMATS, WeightFormat, block_weights, dequantize, quantize

FORMATS = [WeightFormat.Q4_0, WeightFormat.Q4_1, WeightFormat.Q8_0]
_GGUF_TYPE = {
    WeightFormat.Q4_0: gguf.GGMLQuantizationType.Q4_0,
    WeightFormat.Q4_1: gguf.GGMLQuantizationType.Q4_1,
    WeightFormat.Q8_0: gguf.GGMLQuantizationType.Q8_0,
}


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def gguf_dequantize(blocks: torch.Tensor, fmt: WeightFormat) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy(), _GGUF_TYPE[fmt])


def bits(values: torch.Tensor | np.ndarray) -> np.ndarray:
    array = values.numpy() if isinstance(values, torch.Tensor) else values
    return array.astype(np.float32).view(np.uint32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_dequantize_is_gguf_bitwise(fmt: WeightFormat) -> None:
    """quant_formats.dequantize gives gguf.quants.dequantize's exact fp32 bits."""
    blocks = random_blocks(24, 160, fmt, seed=1)
    np.testing.assert_array_equal(bits(dequantize(blocks, fmt)), bits(gguf_dequantize(blocks, fmt)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_is_gguf_bytes(fmt: WeightFormat) -> None:
    """quant_formats.quantize writes gguf.quants.quantize's exact bytes."""
    weight = torch.randn(20, 96, generator=torch.Generator().manual_seed(2)) * 0.3
    weight[3, :32] = 0.0  # an all-zero block: d = 0
    expected = gguf.quants.quantize(weight.numpy(), _GGUF_TYPE[fmt])
    np.testing.assert_array_equal(quantize(weight, fmt).numpy(), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_dequantize_is_gguf_bitwise(quant_library: QuantLibrary, fmt: WeightFormat) -> None:
    """The kernel's in-register dequantization of packed tiles gives gguf's exact bits."""
    n, k = 37, 224
    blocks = random_blocks(n, k, fmt, seed=3)
    weights = quant_ops.kernel_dequantize(quant_ops.pack(blocks, fmt, n, k), fmt, n, k)
    np.testing.assert_array_equal(bits(weights), bits(gguf_dequantize(blocks, fmt)))


def assert_close_to_reference(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, fmt: WeightFormat) -> None:
    """|y - x @ W^T| within the fp32 summation bound K * 2^-24 * (|x| @ |W|^T) of float64."""
    reference = quant_ops.reference_matmul(x, blocks, fmt)
    weights = dequantize(blocks, fmt).to(torch.float64)
    bound = x.shape[-1] * 2.0**-24 * (x.abs().to(torch.float64) @ weights.abs().T) + 1e-30
    error = (y.to(torch.float64) - reference).abs()
    assert y.dtype == torch.float32 and y.shape == reference.shape
    assert bool((error <= bound).all()), f"max error {error.max().item():.3g}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (17, 96), (40, 608), (100, 64)])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 13, 64])
def test_matmul_matches_reference(
    quant_library: QuantLibrary, two_threads: None, fmt: WeightFormat, n: int, k: int, m: int
) -> None:
    """Every format, N not a multiple of the tile, K not a multiple of 64, direct and panel paths."""
    blocks = random_blocks(n, k, fmt, seed=n + k)
    x = random_x(m, k, seed=m)
    y = quant_ops.quant_linear(x, quant_ops.pack(blocks, fmt, n, k), fmt, n, k)
    assert_close_to_reference(y, x, blocks, fmt)


def test_matmul_keeps_leading_dimensions(quant_library: QuantLibrary) -> None:
    """x [2, 3, K] gives y [2, 3, N], row for row the same as the flattened call."""
    fmt, n, k = WeightFormat.Q4_1, 24, 64
    packed = quant_ops.pack(random_blocks(n, k, fmt, seed=4), fmt, n, k)
    x = random_x(6, k, seed=5)
    y = quant_ops.quant_linear(x.reshape(2, 3, k), packed, fmt, n, k)
    assert y.shape == (2, 3, n)
    assert torch.equal(y.reshape(6, n), quant_ops.quant_linear(x, packed, fmt, n, k))


def matmul_with_threads(threads: int, x: torch.Tensor, packed: torch.Tensor, fmt: WeightFormat, n: int) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return quant_ops.quant_linear(x, packed, fmt, n, x.shape[1])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_batch_invariant(quant_library: QuantLibrary, fmt: WeightFormat, threads: int) -> None:
    """Row i of matmul(X[s:s+M]) equals matmul(X[i:i+1]) bit for bit, for M = 1..64, offsets 0 and 3."""
    n, k = 72, 160  # 4.5 tiles: wide and narrow panels, a partial tile
    packed = quant_ops.pack(random_blocks(n, k, fmt, seed=6), fmt, n, k)
    x = random_x(67, k, seed=7)
    singles = torch.cat([matmul_with_threads(threads, x[i : i + 1], packed, fmt, n) for i in range(67)])
    for m in range(1, 65):
        for start in (0, 3):
            batch = matmul_with_threads(threads, x[start : start + m], packed, fmt, n)
            assert torch.equal(batch, singles[start : start + m]), f"M={m} offset={start}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_thread_count_does_not_change_bits(quant_library: QuantLibrary, fmt: WeightFormat) -> None:
    """One and two threads give the same bits at every M, on a shape with many tiles."""
    n, k = 1000, 96
    packed = quant_ops.pack(random_blocks(n, k, fmt, seed=8), fmt, n, k)
    for m in (1, 3, 8, 33):
        x = random_x(m, k, seed=m)
        assert torch.equal(matmul_with_threads(1, x, packed, fmt, n), matmul_with_threads(2, x, packed, fmt, n))


_PRODUCTS = """
out = [quant_ops.quant_linear(x, p, WeightFormat(f), n, x.shape[1]) for x, p, f, n in cases]
"""


@pytest.mark.isa_path(QuantIsa.AVX2)
def test_avx2_build_gives_the_avx512_bits(
    quant_library: QuantLibrary, kernel_builds: KernelBuilds, tmp_path: Path
) -> None:
    """The AVX2+FMA+F16C build compiles and, run in a fresh process, matches this build's bits."""
    if not {"avx2", "fma", "f16c"} <= cpu_features():
        pytest.skip("this CPU cannot run the AVX2 path")
    avx2 = kernel_builds.build(QuantIsa.AVX2)
    assert avx2.isa is QuantIsa.AVX2 and "avx512f" not in avx2.required_features
    cases = []
    for index, fmt in enumerate(FORMATS):
        n, k = 45, 96
        packed = quant_ops.pack(random_blocks(n, k, fmt, seed=9 + index), fmt, n, k)
        cases += [(random_x(m, k, seed=m), packed, fmt.value, n) for m in (1, 3, 7, 20)]
    for (x, packed, fmt, n), y in zip(cases, run_in_build(avx2, _PRODUCTS, cases, tmp_path), strict=True):
        assert torch.equal(y, quant_ops.quant_linear(x, packed, WeightFormat(fmt), n, x.shape[1]))


def test_load_refuses_a_cpu_without_the_features(quant_library: QuantLibrary) -> None:
    """A missing CPU feature is refused in one line naming it and the rebuild command."""
    with pytest.raises(QuantLibraryError) as caught:
        load_quant_library(quant_library.path, [*quant_library.required_features, "avx10_9000"])
    message = str(caught.value)
    assert "avx10_9000" in message and "ifb build" in message and "\n" not in message


def test_bad_packed_size_is_rejected(quant_library: QuantLibrary) -> None:
    """A packed tensor of the wrong size for (n, k) raises instead of reading out of bounds."""
    packed = quant_ops.pack(random_blocks(16, 64, WeightFormat.Q8_0, seed=10), WeightFormat.Q8_0, 16, 64)
    with pytest.raises(RuntimeError, match="expected"):
        quant_ops.quant_linear(random_x(1, 64, seed=0), packed, WeightFormat.Q8_0, 32, 64)


def test_the_library_knows_every_format_of_the_enum_by_its_value(quant_library: QuantLibrary) -> None:
    """The compiled table (block_format_table.h, generated from WeightFormat) has each block
    format's name, block bytes and weights: packed tiles of every format pass the library's size
    check and dequantize, and an unknown name is refused with the enum's values in its order."""
    for fmt in BLOCK_FORMATS:
        n, k = 17, 2 * block_weights(fmt)
        blocks = random_blocks(n, k, fmt, seed=11)
        weights = quant_ops.kernel_dequantize(quant_ops.pack(blocks, fmt, n, k), fmt, n, k)
        np.testing.assert_array_equal(bits(weights), bits(dequantize(blocks, fmt)))
    known = ", ".join(fmt.value for fmt in BLOCK_FORMATS)
    with pytest.raises(RuntimeError, match=re.escape(f"unknown block format 'fp32' ({known})")):
        torch.ops.ifb_quant.quant_dequantize(torch.zeros(16 * 34, dtype=torch.uint8), "fp32", 1, 32)
