"""MXFP4 (gpt-oss's experts): gguf's quantizer and dequantizer bit for bit, at every scale.

Pins: `quantize_mxfp4` writes gguf.quants.MXFP4's bytes for random weights over the whole fp32
range (all-zero blocks, subnormal and tiny ones whose exponent wraps, maxima near FLT_MAX, exact
ties between two values, powers of two and the floats just below them, where log2's rounding
decides the scale); `dequantize` and the kernels' decoder (both packings: the exact matmul's and
the int8 one's, read through the embedding gather) give gguf's fp32 bits for every one of the 256
scale bytes with every code, subnormal scales and overflow to inf included. The matmuls over
MXFP4 are tested with every other format's in test_kquant_kernels.py and test_grouped_experts.py.
"""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import QuantLibrary
from ifb.plugins.quant_formats import WeightCompute, WeightFormat, dequantize, quantize_mxfp4

MXFP4 = WeightFormat.MXFP4
GGUF_MXFP4 = gguf.GGMLQuantizationType.MXFP4


def bits(values: torch.Tensor | np.ndarray) -> np.ndarray:
    array = values.numpy() if isinstance(values, torch.Tensor) else values
    return np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)


def gguf_quantize(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # gguf's own overflow (near FLT_MAX) and invalid-cast warnings
        warnings.simplefilter("ignore", RuntimeWarning)
        return gguf.quants.quantize(x, GGUF_MXFP4)


def gguf_dequantize(blocks: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return gguf.quants.dequantize(blocks, GGUF_MXFP4)


def hard_weights() -> np.ndarray:
    """[48, 256] fp32: random blocks at scales 2^-149 .. 2^126, and rows of the edge cases."""
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (48, 256)).astype(np.float32)
    scales = np.exp2(rng.integers(-149, 127, (48 * 8, 1))).astype(np.float32)
    x = (x.reshape(-1, 32) * scales).reshape(48, 256)
    x[0] = 0.0  # all-zero blocks: e = 0
    x[1, :32] = -0.0
    x[2] = np.float32(1e-39) * np.sign(x[2])  # subnormal maxima: the exponent wraps (e = 251)
    x[3] = np.float32(2.0**-125) * np.sign(x[3])  # the smallest maximum with e >= 0
    x[4] = np.float32(3.4e38) * np.sign(x[4])  # near FLT_MAX: 2^(e-128) * 12 is not even needed
    powers = np.exp2(np.arange(-140, 116, dtype=np.float32)).astype(np.float32)
    x[5] = powers  # each block spans 32 octaves
    x[6] = np.nextafter(powers, np.float32(0))  # just below: floor(log2) decided by rounding
    # exact ties: a block whose maximum is 12 d has half-scale d, so d times the midpoints between
    # neighbouring doubled values lies halfway between two codes (the first one wins); d = 0.5
    midpoints = np.array([0.5, 1.5, 2.5, 3.5, 5, 7, 10, 12], np.float32)
    block = np.concatenate([midpoints, -midpoints, midpoints * 0.5, -midpoints * 0.5])
    x[7] = np.tile(block, 8) * np.float32(0.5)
    return x


def test_quantize_writes_gguf_s_bytes() -> None:
    x = hard_weights()
    expected = gguf_quantize(x)
    ours = quantize_mxfp4(torch.from_numpy(x)).numpy()
    assert ours.shape == expected.shape == (48, 8 * 17)
    np.testing.assert_array_equal(ours, expected)
    assert (ours[2].reshape(8, 17)[:, 0] == 251).all()  # gguf's wrap, kept
    assert (ours[0].reshape(8, 17) == 0).all()


def test_quantize_refuses_a_row_of_partial_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 32 to quantize to mxfp4, got 48"):
        quantize_mxfp4(torch.zeros(2, 48))


def every_scale_and_code() -> np.ndarray:
    """[32, 136]: 256 blocks, block e has scale byte e and codes 0..15 twice (shuffled per block)."""
    rng = np.random.default_rng(1)
    codes = np.stack([rng.permutation(np.tile(np.arange(16, dtype=np.uint8), 2)) for _ in range(256)])
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    blocks = np.concatenate([np.arange(256, dtype=np.uint8)[:, None], packed], axis=1)
    return blocks.reshape(32, 8 * 17)


def test_dequantize_is_gguf_bitwise_at_every_scale() -> None:
    blocks = every_scale_and_code()
    expected = gguf_dequantize(blocks)
    assert np.isinf(expected).any() and (expected[expected != 0] != 0).any()
    assert (np.abs(expected[expected != 0]) < np.float32(2.0**-126)).any()  # subnormal weights
    np.testing.assert_array_equal(bits(dequantize(torch.from_numpy(blocks), MXFP4)), bits(expected))


@pytest.mark.parametrize("compute", list(WeightCompute))
def test_kernel_decoder_is_gguf_bitwise_at_every_scale(quant_library: QuantLibrary, compute: WeightCompute) -> None:
    """The tile decoder of each packing: the exact layout through kernel_dequantize too."""
    blocks = torch.from_numpy(every_scale_and_code())
    n, k = 32, 256
    expected = bits(gguf_dequantize(blocks.numpy()))
    packed = (quant_ops.pack if compute is WeightCompute.FP32 else quant_ops.pack_int8)(blocks, MXFP4, n, k)
    rows = quant_ops.quant_embedding(torch.arange(n), packed, MXFP4, compute, n, k)
    np.testing.assert_array_equal(bits(rows), expected)
    if compute is WeightCompute.FP32:
        np.testing.assert_array_equal(bits(quant_ops.kernel_dequantize(packed, MXFP4, n, k)), expected)


def test_int8_dot_is_exact_at_the_largest_values(quant_library: QuantLibrary) -> None:
    """Every weight +-12 (codes 7 and 15) and every activation +-127 after quantization: the
    integer dot reaches 32 x 12 x 127 per block. With x = +-127/128 (d_x = 2^-7 exactly) every
    product and sum is exact, so the result is the float64 reference's to the bit (a wrong zero
    point, value table or scale shows as a whole multiple of 2^-8)."""
    n, k = 16, 64
    codes = np.where(np.arange(n * k).reshape(n, k) % 3 == 0, 15, 7).astype(np.uint8).reshape(-1, 32)
    blocks = np.concatenate([np.full((codes.shape[0], 1), 127, np.uint8), codes[:, :16] | (codes[:, 16:] << 4)], 1)
    weights = torch.from_numpy(blocks.reshape(n, -1))
    x = torch.where(torch.arange(3 * k).reshape(3, k) % 5 == 0, -127 / 128, 127 / 128)
    y = quant_ops.quant_linear_int8(x, quant_ops.pack_int8(weights, MXFP4, n, k), MXFP4, n, k)
    expected = quant_ops.reference_matmul_int8(x, weights, MXFP4)
    assert torch.equal(y.to(torch.float64), expected), (y.to(torch.float64) - expected).abs().max()
