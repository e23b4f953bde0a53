"""`--compute int8` against the K-quants: activations per 256-weight super-block (issue #38).

Pins: the kernel quantizes a row per 256 values exactly as `quant_ops.quantize_activations(x, 256)`
(ties to even, a zero super-block stays zero); with d = dmin = d_x = 1 every product is an integer
and the output is the float64 reference's exact value, so the int32 sums over a super-block
(sub-block scale x dot, mins x sums, Q6_K's zero point) are exact; random blocks stay within a few
fp32 roundings per super-block of it; a row's bits depend neither on M (below, at and past the
8-row block), its position, nor the thread count; the AVX2 and AVX-512-without-VNNI builds give
this build's bits; and per-256 activations are no farther from the exact product than per-32.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from quant_cases import random_blocks, random_x

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import QuantIsa, QuantLibrary, build_quant_library, cpu_features, load_quant_library
from ifb.plugins.quant_formats import WeightFormat, dequantize

K_QUANTS = [WeightFormat.Q4_K, WeightFormat.Q5_K, WeightFormat.Q6_K]
SUPER = 256
ONE = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)


@pytest.fixture(scope="module")
def quant_library(tmp_path_factory: pytest.TempPathFactory) -> QuantLibrary:
    library = build_quant_library(tmp_path_factory.mktemp("quant-lib-super"))
    load_quant_library(library.path, library.required_features)
    return library


def int8_matmul(x: torch.Tensor, blocks: torch.Tensor, fmt: WeightFormat, threads: int = 2) -> torch.Tensor:
    n, k = blocks.shape[0], x.shape[-1]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return quant_ops.quant_linear_int8(x, quant_ops.pack_int8(blocks, fmt, n, k), fmt, n, k)
    finally:
        torch.set_num_threads(before)


def with_unit_scales(blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """The same blocks with d = 1 (and dmin = 1 for Q4_K/Q5_K): every weight an integer."""
    size = {WeightFormat.Q4_K: 144, WeightFormat.Q5_K: 176, WeightFormat.Q6_K: 210}[fmt]
    out = blocks.clone().reshape(blocks.shape[0], -1, size)
    for offset in (208,) if fmt is WeightFormat.Q6_K else (0, 2):
        out[:, :, offset : offset + 2] = ONE
    return out.reshape(blocks.shape)


def integer_x(m: int, k: int, seed: int) -> torch.Tensor:
    """Integers in [-127, 127] with 127 or -127 in every super-block: d_x = 1 exactly."""
    x = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(seed)).to(torch.float32)
    x[:, ::SUPER] = torch.where(torch.arange(m)[:, None] % 2 == 0, 127.0, -127.0)
    return x


def identity_q4_k(k: int) -> torch.Tensor:
    """Q4_K blocks of the k x k identity: d = 1, every sub-block scale 1 and min 0, quant 1 at column n."""
    blocks = torch.zeros(k, k // SUPER, 144, dtype=torch.uint8)
    blocks[:, :, 0:2] = ONE
    blocks[:, :, 4:8] = 1  # sc of sub-blocks 0..3 (6 bits; mins 0)
    blocks[:, :, 12:16] = 1  # sub-blocks 4..7: low nibbles of bytes 8..11
    for n in range(k):
        weight = n % SUPER
        chunk, rest = divmod(weight, 64)
        byte = 16 + 32 * chunk + rest % 32
        blocks[n, n // SUPER, byte] = 1 if rest < 32 else 0x10
    return blocks.reshape(k, -1)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_quantizes_per_super_block_as_the_reference(quant_library: QuantLibrary, threads: int) -> None:
    """Through identity Q4_K weights each output is one rounding of q * d_x: the kernel's own int8
    values and per-256 scales equal quantize_activations(x, 256)'s (ties to even, zero super-blocks 0)."""
    k = 512
    assert torch.equal(dequantize(identity_q4_k(k), WeightFormat.Q4_K), torch.eye(k))
    x = random_x(19, k, seed=5)
    x[1, SUPER:] = 0.0
    x[2, :SUPER] = 0.0
    x[2, 0] = 127.0  # d = 1: the rest are ties
    x[2, 1:6] = torch.tensor([2.5, -3.5, 0.5, -0.5, 1.5])
    y = int8_matmul(x, identity_q4_k(k), WeightFormat.Q4_K, threads)
    q, d = quant_ops.quantize_activations(x, SUPER)
    expected = (q.to(torch.float32).reshape(19, -1, SUPER) * d[..., None]).reshape(19, k)
    assert torch.equal(y, expected)
    assert y[2, 1:6].tolist() == [2.0, -4.0, 0.0, -0.0, 2.0] and not y[1, SUPER:].any()


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("m", [1, 3, 8, 11])
def test_integer_parts_are_exact(quant_library: QuantLibrary, fmt: WeightFormat, m: int) -> None:
    """d = dmin = d_x = 1: the output is the integer sum itself, equal to the float64 reference."""
    n, k = 37, 512
    blocks = with_unit_scales(random_blocks(n, k, fmt, seed=m), fmt)
    x = integer_x(m, k, seed=m)
    y = int8_matmul(x, blocks, fmt)
    reference = quant_ops.reference_matmul_int8(x, blocks, fmt)
    assert reference.abs().max() < 2.0**24 and reference.abs().max() > 2.0**12
    assert torch.equal(y.to(torch.float64), reference)


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 17, 64])
def test_matches_the_quantized_reference(quant_library: QuantLibrary, fmt: WeightFormat, m: int) -> None:
    """Random blocks: within a few fp32 roundings per super-block of the float64 reference."""
    n, k = 37, 1024
    blocks = random_blocks(n, k, fmt, seed=m + 1)
    x = random_x(m, k, seed=m)
    x[0, :SUPER] = 0.0  # a zero super-block (d = 0)
    y = int8_matmul(x, blocks, fmt)
    q, d = quant_ops.quantize_activations(x, SUPER)
    x_hat = quant_ops.dequantize_activations(q, d)
    bound = 8 * (k // SUPER + 2) * 2.0**-24 * (x_hat.abs() @ dequantize(blocks, fmt).abs().to(torch.float64).T)
    error = (y.to(torch.float64) - quant_ops.reference_matmul_int8(x, blocks, fmt)).abs()
    assert y.shape == (m, n) and bool((error <= bound + 1e-30).all()), f"max error {error.max().item():.3g}"


@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_batch_invariant(quant_library: QuantLibrary, fmt: WeightFormat, threads: int) -> None:
    """Row i of matmul(X[s:s+M]) equals matmul(X[i:i+1]) bit for bit, M = 1..27 (the 8-row block,
    its remainders), 64, 65, 100; offsets 0 and 5."""
    n, k = 72, 512
    packed = quant_ops.pack_int8(random_blocks(n, k, fmt, seed=6), fmt, n, k)

    def run(x: torch.Tensor) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return quant_ops.quant_linear_int8(x, packed, fmt, n, k)
        finally:
            torch.set_num_threads(before)

    x = random_x(105, k, seed=7)
    singles = torch.cat([run(x[i : i + 1]) for i in range(105)])
    for m in [*range(1, 28), 64, 65, 100]:
        for start in (0, 5):
            assert torch.equal(run(x[start : start + m]), singles[start : start + m]), f"M={m} offset={start}"


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_per_256_is_no_farther_from_the_exact_product(quant_library: QuantLibrary, fmt: WeightFormat) -> None:
    """On activations like a transformer's (a few large outlier channels), per-256 scales cost more
    than per-32 but stay within 3% relative error of the exact product (llama.cpp's Q8_K trade)."""
    n, k = 64, 1024
    blocks = random_blocks(n, k, fmt, seed=5)
    x = random_x(16, k, seed=4)
    x[:, 7::97] *= 8.0  # outlier channels
    exact = quant_ops.reference_matmul(x, blocks, fmt)
    y = int8_matmul(x, blocks, fmt).to(torch.float64)
    q, d = quant_ops.quantize_activations(x, 32)
    per_32 = quant_ops.dequantize_activations(q, d) @ dequantize(blocks, fmt).to(torch.float64).T
    error, error_32 = ((y - exact).norm() / exact.norm()).item(), ((per_32 - exact).norm() / exact.norm()).item()
    assert error < 0.03 and error_32 < error


_OTHER_BUILD = """
import sys, torch
from pathlib import Path
from ifb.plugins import quant_ops
from ifb.plugins.quant_build import load_quant_library
assert load_quant_library(Path(sys.argv[1]), []) == sys.argv[4]
cases = torch.load(sys.argv[2])
torch.save([quant_ops.quant_linear_int8(x, p, quant_ops.WeightFormat(f), n, x.shape[1]) for x, p, f, n in cases], sys.argv[3])
"""


@pytest.mark.parametrize("isa", [QuantIsa.AVX2, QuantIsa.AVX512])
def test_other_isa_builds_give_the_same_bits(quant_library: QuantLibrary, tmp_path: Path, isa: QuantIsa) -> None:
    """maddubs (AVX2, AVX-512 without VNNI) and vpdpbusd + vpdpwssd form the same exact integers."""
    if isa.value == quant_library.isa.value:
        pytest.skip(f"{isa.value} is this machine's own build")
    other = build_quant_library(tmp_path / isa.value, isa)
    if not set(other.required_features) <= cpu_features():
        pytest.skip(f"this CPU cannot run the {isa.value} path")
    cases = []
    for index, fmt in enumerate(K_QUANTS):
        n, k = 45, 512
        packed = quant_ops.pack_int8(random_blocks(n, k, fmt, seed=9 + index), fmt, n, k)
        cases += [(random_x(m, k, seed=m), packed, fmt.value, n) for m in (1, 3, 8, 20)]
    torch.save(cases, tmp_path / "cases.pt")
    command = [sys.executable, "-c", _OTHER_BUILD, str(other.path), str(tmp_path / "cases.pt"), str(tmp_path / "y.pt")]
    result = subprocess.run([*command, isa.value], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    for (x, packed, fmt, n), y in zip(cases, torch.load(tmp_path / "y.pt"), strict=True):
        assert torch.equal(y, quant_ops.quant_linear_int8(x, packed, WeightFormat(fmt), n, x.shape[1]))
