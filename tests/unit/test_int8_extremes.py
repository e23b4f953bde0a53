"""The int8 kernel with every Q6_K dot at the largest magnitude its operands allow (issue #38).

Two of the kernel's shortcuts are exact only below a bound that random blocks never approach:
the maddubs builds (AVX2, AVX-512 without VNNI) add two u8 x s8 pair sums in int16 before one
madd widens them (simd16.h dot_unsigned2: <= 4 * 63 * 127 = 32004 < 2^15 for 6-bit weights), and
Q6_K's epilogue forms sc0 dot0 + sc1 dot1 in fp32 (quant_matmul_int8.cpp finish_block: below 2^24).
Here weights sit at 0 and 63, the half scales at -128 and 127, activations at +-127, with 10 rows
(one 8-row weight-stationary block and a 2-row register block) over two tiles. Every partial sum is
an integer that fp32 holds exactly, so each build must equal the float64 reference exactly, and the
other ISA builds this CPU runs must give this build's bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_builds import KernelBuilds
from other_isa import other_isa_build, run_in_build

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import QuantIsa, QuantLibrary
from ifb.plugins.quant_formats import WeightFormat

N, K, M = 32, 512, 10


def extreme_q6_k() -> torch.Tensor:
    """Q6_K rows: even columns every quant 63, odd ones 0; half scales -128 (columns 0, 1 mod 4) or
    127; d = 1 (the 210-byte block: ql[128], qh[64], scales[16] int8, d fp16)."""
    blocks = torch.zeros(N, K // 256, 210, dtype=torch.uint8)
    blocks[0::2, :, :192] = 0xFF  # low nibbles 15, high bit pairs 3: q = 63
    for column in range(N):
        blocks[column, :, 192:208] = 0x80 if column % 4 < 2 else 0x7F
    blocks[:, :, 208:210] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    return blocks.reshape(N, -1)


def extreme_x() -> torch.Tensor:
    """Rows of +127 and -127: d_x = 1 exactly, so the quantized activations are the values themselves."""
    signs = torch.tensor([1.0 if row % 2 == 0 else -1.0 for row in range(M)])
    return (127.0 * signs)[:, None].expand(M, K).contiguous()


def test_extreme_q6_k_dots_are_exact(quant_library: QuantLibrary) -> None:
    blocks, x = extreme_q6_k(), extreme_x()
    y = quant_ops.quant_linear_int8(x, quant_ops.pack_int8(blocks, WeightFormat.Q6_K, N, K), WeightFormat.Q6_K, N, K)
    reference = quant_ops.reference_matmul_int8(x, blocks, WeightFormat.Q6_K)
    assert reference.abs().max() > 2.0**26  # the edge is reached: |sc0 dot0 + sc1 dot1| ~ 1.6e7 per 32
    assert torch.equal(y.to(torch.float64), reference)


_PRODUCT = """
x, packed, n = cases
out = quant_ops.quant_linear_int8(x, packed, WeightFormat.Q6_K, n, x.shape[1])
"""


@pytest.mark.parametrize("isa", [QuantIsa.AVX2, QuantIsa.AVX512])
def test_other_isa_builds_give_the_same_bits_at_the_extremes(
    quant_library: QuantLibrary, kernel_builds: KernelBuilds, tmp_path: Path, isa: QuantIsa
) -> None:
    other = other_isa_build(kernel_builds, isa)
    x, packed = extreme_x(), quant_ops.pack_int8(extreme_q6_k(), WeightFormat.Q6_K, N, K)
    theirs = run_in_build(other, _PRODUCT, (x, packed, N), tmp_path)
    assert torch.equal(theirs, quant_ops.quant_linear_int8(x, packed, WeightFormat.Q6_K, N, K))
