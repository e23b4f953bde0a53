"""Q5_0/Q5_1, the K-quants (Q4_K/Q5_K/Q6_K) and MXFP4 in both kernels, and the embedding gather for all formats.

Pins: the pure-torch and the in-register dequantization are gguf's exact bits for random valid
blocks; the exact matmul is within fp32 rounding of float64, the int8 one within its bound of
the quantized-activation reference; a row's bits depend neither on M, nor its position, nor the
thread count, in both modes; `quant_embedding` returns dequantize's rows from either packing and
refuses an id outside the table; the AVX2 and AVX-512-without-VNNI builds give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kernel_builds import KernelBuilds
from other_isa import other_isa_build, run_in_build
from quant_cases import random_blocks, random_x

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import QuantIsa, QuantLibrary
from ifb.plugins.quant_formats import (
    BLOCK_SIZE,
    GGUF_TYPE_NAMES,
    WeightCompute,
    WeightFormat,
    block_bytes,
    block_weights,
    dequantize,
    quantize,
)
from ifb.runtime.step.quant_linear import QuantLinear, packed_shape

NEW_FORMATS = [
    WeightFormat.Q5_0,
    WeightFormat.Q5_1,
    WeightFormat.Q4_K,
    WeightFormat.Q5_K,
    WeightFormat.Q6_K,
    WeightFormat.MXFP4,
]
ALL_FORMATS = [fmt for fmt in WeightFormat if fmt.is_block]
PACKERS = {WeightCompute.FP32: quant_ops.pack, WeightCompute.INT8: quant_ops.pack_int8}


def bits(values: torch.Tensor | np.ndarray) -> np.ndarray:
    array = values.numpy() if isinstance(values, torch.Tensor) else values
    return array.astype(np.float32).view(np.uint32)


def gguf_dequantize(blocks: torch.Tensor, fmt: WeightFormat) -> np.ndarray:
    name = next(name for name, value in GGUF_TYPE_NAMES.items() if value is fmt)
    return gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[name])


def shape_for(fmt: WeightFormat) -> tuple[int, int]:
    """N not a multiple of 16; K a few blocks (two super-blocks for the K-quants)."""
    return (37, 512) if block_weights(fmt) == 256 else (37, 224)


def with_threads(threads: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def matmul(
    compute: WeightCompute, x: torch.Tensor, packed: torch.Tensor, fmt: WeightFormat, n: int, threads: int = 2
) -> torch.Tensor:
    op = quant_ops.quant_linear if compute is WeightCompute.FP32 else quant_ops.quant_linear_int8
    return with_threads(threads, lambda: op(x, packed, fmt, n, x.shape[-1]))


def test_format_table_is_gguf_s() -> None:
    """Every GGUF type name maps to the format of that name, with gguf's block bytes and weights."""
    assert set(GGUF_TYPE_NAMES) == {"Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}
    for name, fmt in GGUF_TYPE_NAMES.items():
        weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert fmt.name == name and (block_weights(fmt), block_bytes(fmt)) == (weights, size)
    with pytest.raises(ValueError, match="Q4_0, Q4_1 and Q8_0 only"):
        quantize(torch.zeros(2, 256), WeightFormat.Q4_K)


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_reference_dequantize_is_gguf_bitwise(fmt: WeightFormat) -> None:
    """quant_formats.dequantize gives gguf.quants.dequantize's exact fp32 bits."""
    blocks = random_blocks(24, 1024 if block_weights(fmt) == 256 else 160, fmt, seed=1)
    expected = gguf_dequantize(blocks, fmt)
    assert np.isfinite(expected).all()
    np.testing.assert_array_equal(bits(dequantize(blocks, fmt)), bits(expected))


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_kernel_dequantize_is_gguf_bitwise(quant_library: QuantLibrary, fmt: WeightFormat) -> None:
    """The kernel's in-register dequantization of `pack`'s tiles gives gguf's exact bits."""
    n, k = shape_for(fmt)
    blocks = random_blocks(n, k, fmt, seed=3)
    weights = quant_ops.kernel_dequantize(quant_ops.pack(blocks, fmt, n, k), fmt, n, k)
    np.testing.assert_array_equal(bits(weights), bits(gguf_dequantize(blocks, fmt)))


@pytest.mark.parametrize("fmt", NEW_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13, 64])
def test_exact_matmul_matches_reference(quant_library: QuantLibrary, fmt: WeightFormat, m: int) -> None:
    """Within the fp32 summation bound K * 2^-24 * (|x| @ |W|^T) of float64, direct and panel paths."""
    n, k = shape_for(fmt)
    blocks = random_blocks(n, k, fmt, seed=m)
    x = random_x(m, k, seed=m)
    y = matmul(WeightCompute.FP32, x, quant_ops.pack(blocks, fmt, n, k), fmt, n)
    weights = dequantize(blocks, fmt).to(torch.float64)
    bound = k * 2.0**-24 * (x.abs().to(torch.float64) @ weights.abs().T) + 1e-30
    error = (y.to(torch.float64) - quant_ops.reference_matmul(x, blocks, fmt)).abs()
    assert y.shape == (m, n) and bool((error <= bound).all()), f"max error {error.max().item():.3g}"


@pytest.mark.parametrize("fmt", NEW_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 13, 64])
def test_int8_matmul_matches_the_quantized_reference(quant_library: QuantLibrary, fmt: WeightFormat, m: int) -> None:
    """The integer dots are exact: only a few fp32 roundings per 32-block separate it from float64."""
    n, k = shape_for(fmt)
    blocks = random_blocks(n, k, fmt, seed=m + 1)
    x = random_x(m, k, seed=m)
    x[0, :BLOCK_SIZE] = 0.0  # a zero activation block (d = 0)
    y = matmul(WeightCompute.INT8, x, quant_ops.pack_int8(blocks, fmt, n, k), fmt, n)
    q, d = quant_ops.quantize_activations(x)
    x_hat = (q.to(torch.float64).reshape(m, -1, BLOCK_SIZE) * d.to(torch.float64)[..., None]).reshape(m, k)
    bound = 4 * (k // BLOCK_SIZE + 2) * 2.0**-24 * (x_hat.abs() @ dequantize(blocks, fmt).abs().to(torch.float64).T)
    error = (y.to(torch.float64) - quant_ops.reference_matmul_int8(x, blocks, fmt)).abs()
    assert y.shape == (m, n) and bool((error <= bound + 1e-30).all()), f"max error {error.max().item():.3g}"


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_int8_is_close_to_the_exact_product(quant_library: QuantLibrary, fmt: WeightFormat) -> None:
    """Per-32-block int8 activations cost about 1% relative error against the exact weights."""
    n, k = 64, 512
    blocks = random_blocks(n, k, fmt, seed=5)
    x = random_x(8, k, seed=4)
    y = quant_ops.quant_linear_int8(x, quant_ops.pack_int8(blocks, fmt, n, k), fmt, n, k).to(torch.float64)
    exact = quant_ops.reference_matmul(x, blocks, fmt)
    assert (y - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("compute", list(WeightCompute))
@pytest.mark.parametrize("fmt", NEW_FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_batch_invariant(
    quant_library: QuantLibrary, compute: WeightCompute, fmt: WeightFormat, threads: int
) -> None:
    """Row i of matmul(X[s:s+M]) equals matmul(X[i:i+1]) bit for bit, M = 1..40, 64, 65 and 100
    (split into two row halves across threads), offsets 0 and 3."""
    n, k = 72, 256  # 4.5 tiles: wide and narrow panels / tile groups, a partial tile
    packed = PACKERS[compute](random_blocks(n, k, fmt, seed=6), fmt, n, k)
    x = random_x(103, k, seed=7)
    singles = torch.cat([matmul(compute, x[i : i + 1], packed, fmt, n, threads) for i in range(103)])
    for m in [*range(1, 41), 64, 65, 100]:
        for start in (0, 3):
            batch = matmul(compute, x[start : start + m], packed, fmt, n, threads)
            assert torch.equal(batch, singles[start : start + m]), f"M={m} offset={start}"


@pytest.mark.parametrize("compute", list(WeightCompute))
@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_thread_count_does_not_change_bits(
    quant_library: QuantLibrary, compute: WeightCompute, fmt: WeightFormat
) -> None:
    n, k = 1000, 256
    packed = PACKERS[compute](random_blocks(n, k, fmt, seed=8), fmt, n, k)
    for m in (1, 3, 8, 33):
        x = random_x(m, k, seed=m)
        one = matmul(compute, x, packed, fmt, n, threads=1)
        assert torch.equal(one, matmul(compute, x, packed, fmt, n, threads=2))


@pytest.mark.parametrize("compute", list(WeightCompute))
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_embedding_gathers_exact_rows_from_either_packing(
    quant_library: QuantLibrary, compute: WeightCompute, fmt: WeightFormat
) -> None:
    """quant_embedding(ids) is dequantize's rows, bit for bit, in ids' shape, from the matmul's own tiles."""
    n, k = shape_for(fmt)
    blocks = random_blocks(n, k, fmt, seed=9)
    packed = PACKERS[compute](blocks, fmt, n, k)
    ids = torch.tensor([[0, 36, 5, 5], [17, 16, 15, 1]])
    rows = quant_ops.quant_embedding(ids, packed, fmt, compute, n, k)
    assert rows.shape == (2, 4, k) and rows.dtype == torch.float32
    np.testing.assert_array_equal(bits(rows), bits(dequantize(blocks, fmt)[ids]))
    everything = quant_ops.quant_embedding(torch.arange(n, dtype=torch.int32), packed, fmt, compute, n, k)
    np.testing.assert_array_equal(bits(everything), bits(gguf_dequantize(blocks, fmt)))


@pytest.mark.parametrize("bad", [-1, 37])
def test_embedding_refuses_an_id_outside_the_table(quant_library: QuantLibrary, bad: int) -> None:
    fmt, n, k = WeightFormat.Q6_K, 37, 256
    packed = quant_ops.pack(random_blocks(n, k, fmt, seed=10), fmt, n, k)
    with pytest.raises(RuntimeError, match=f"embedding id {bad} .* outside the table of 37 rows"):
        quant_ops.quant_embedding(torch.tensor([3, bad]), packed, fmt, WeightCompute.FP32, n, k)


def test_k_not_a_multiple_of_the_super_block_is_refused(quant_library: QuantLibrary) -> None:
    """K must be a multiple of 256 for the K-quants, in the packer, the module and the op."""
    with pytest.raises(ValueError, match="multiple of 256"):
        quant_ops.pack(random_blocks(16, 256, WeightFormat.Q4_K, seed=11), WeightFormat.Q4_K, 16, 288)
    with pytest.raises(ValueError, match="K % 256 == 0"):
        QuantLinear(WeightFormat.Q4_K, 288, 16)
    packed = torch.zeros(packed_shape(WeightFormat.Q4_0, 16, 288), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        quant_ops.quant_linear(random_x(1, 288, seed=0), packed, WeightFormat.Q4_K, 16, 288)


@pytest.mark.parametrize("compute", list(WeightCompute))
def test_quant_linear_module_runs_a_k_quant(quant_library: QuantLibrary, compute: WeightCompute) -> None:
    """QuantLinear holds `packed_shape` tiles of a Q5_K weight and computes the op's product."""
    n, k, fmt = 40, 512, WeightFormat.Q5_K
    blocks = random_blocks(n, k, fmt, seed=12)
    layer = QuantLinear(fmt, k, n, compute=compute)
    layer.packed.copy_(PACKERS[compute](blocks, fmt, n, k))
    x = random_x(3, k, seed=13)
    assert torch.equal(layer(x), matmul(compute, x, layer.packed, fmt, n))


_PRODUCTS_AND_ROWS = """
ops = {"fp32": quant_ops.quant_linear, "int8": quant_ops.quant_linear_int8}
out = []
for x, p, f, n, compute in cases:
    fmt = WeightFormat(f)
    out.append(ops[compute](x, p, fmt, n, x.shape[1]))
    out.append(quant_ops.quant_embedding(torch.arange(n), p, fmt, WeightCompute(compute), n, x.shape[1]))
"""


@pytest.mark.parametrize("isa", [QuantIsa.AVX2, QuantIsa.AVX512])
def test_other_isa_builds_give_the_same_bits(
    quant_library: QuantLibrary, kernel_builds: KernelBuilds, tmp_path: Path, isa: QuantIsa
) -> None:
    """AVX2 (maddubs, two ymm per vector) and AVX-512 without VNNI give this build's exact bits, both modes."""
    other = other_isa_build(kernel_builds, isa)
    cases = []
    for index, fmt in enumerate(NEW_FORMATS):
        n, k = 45, 512
        blocks = random_blocks(n, k, fmt, seed=20 + index)
        for compute, packer in PACKERS.items():
            cases += [
                (random_x(m, k, seed=m), packer(blocks, fmt, n, k), fmt.value, n, compute.value) for m in (1, 3, 7, 20)
            ]
    theirs = run_in_build(other, _PRODUCTS_AND_ROWS, cases, tmp_path)
    for index, (x, packed, fmt, n, compute) in enumerate(cases):
        product = matmul(WeightCompute(compute), x, packed, WeightFormat(fmt), n)
        rows = quant_ops.quant_embedding(
            torch.arange(n), packed, WeightFormat(fmt), WeightCompute(compute), n, x.shape[1]
        )
        assert torch.equal(theirs[2 * index], product), f"{fmt} {compute} M={x.shape[0]}"
        assert torch.equal(theirs[2 * index + 1], rows), f"{fmt} {compute} embedding"
