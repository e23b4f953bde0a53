"""The paged decode attention kernel against the compiled torch path it replaces.

Pins: for fp32, fp16 and bf16 pools, grouped heads, lengths from 1 to a full table and blocks
scattered over the pool, the kernel's output is within fp32 rounding of `_decode_attention`
over gathered K/V; a request's output is bitwise the same alone, in a batch, in another
position, and with 1 or 2 threads; a sliding window reads each row's last keys only; Gemma 2's
soft-cap bends each score as the torch path does, windowed or not; AVX2 and AVX-512 builds give
the same bits (q8_0 pools too); bad tables are refused instead of read out of bounds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ifb.plugins.attention import _decode_attention, _gather_blocks
from ifb.plugins.kv_format import quantize_q8_0
from ifb.plugins.quant_build import QuantIsa, QuantLibrary, build_quant_library, cpu_features, load_quant_library

BLOCK = 16
SLOTS = 128 * BLOCK


@pytest.fixture(scope="module")
def kernel_library(tmp_path_factory: pytest.TempPathFactory) -> QuantLibrary:
    library = build_quant_library(tmp_path_factory.mktemp("attention-lib"))
    load_quant_library(library.path, library.required_features)
    return library


def case(
    rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(SLOTS, kv_heads, head_dim, generator=generator).to(dtype)
    v_pool = torch.randn(SLOTS, kv_heads, head_dim, generator=generator).to(dtype)
    q = torch.randn(rows, heads, head_dim, generator=generator) * 2
    tables = torch.randperm(SLOTS // BLOCK, generator=generator)[: rows * 9].reshape(rows, 9)
    lengths = torch.randint(1, 9 * BLOCK + 1, (rows,), generator=generator)
    lengths[0], lengths[-1] = 1, 9 * BLOCK  # one key; a full table
    return q, k_pool, v_pool, tables, lengths


def kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    return torch.ops.ifb_quant.paged_decode_attention(q, k, v, tables, lengths, BLOCK, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (2, 2, 32)])
def test_matches_the_compiled_torch_path(
    kernel_library: QuantLibrary, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    q, k_pool, v_pool, tables, lengths = case(7, heads, kv_heads, head_dim, dtype, seed=heads + head_dim)
    keys, values = _gather_blocks(k_pool, tables, BLOCK), _gather_blocks(v_pool, tables, BLOCK)
    mask = torch.arange(keys.shape[1])[None] < lengths[:, None]
    expected = _decode_attention(q, keys, values, mask, 0.125)
    got = kernel(q, k_pool, v_pool, tables, lengths)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # outputs are averages of unit-scale values: a few fp32 ulps of 1 (exp polynomial, sum order)
    assert (got - expected).abs().max().item() < 2e-6
    one_key = v_pool[tables[0, 0] * BLOCK].float().repeat_interleave(heads // kv_heads, dim=0)
    assert torch.allclose(got[0], one_key, atol=1e-6)  # a single key: softmax weight 1


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bitwise_batch_invariant(kernel_library: QuantLibrary, threads: int) -> None:
    q, k_pool, v_pool, tables, lengths = case(12, 9, 3, 64, torch.float32, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel(q, k_pool, v_pool, tables, lengths)
        order = torch.randperm(12, generator=torch.Generator().manual_seed(1))
        shuffled = kernel(q[order], k_pool, v_pool, tables[order], lengths[order])
        assert torch.equal(shuffled, together[order])
        for row in range(12):
            alone = kernel(q[row : row + 1], k_pool, v_pool, tables[row : row + 1], lengths[row : row + 1])
            assert torch.equal(alone[0], together[row]), row
    finally:
        torch.set_num_threads(before)


def windowed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, window: int
) -> torch.Tensor:
    return torch.ops.ifb_quant.paged_decode_attention_window(q, k, v, tables, lengths, BLOCK, 0.125, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_a_window_reads_only_each_rows_last_keys(kernel_library: QuantLibrary, dtype: torch.dtype, window: int) -> None:
    """Sliding window (Mistral): a row of length L attends to keys [L - window, L), as the
    compiled torch path masked to them; rows shorter than the window see all their keys, bitwise
    as without a window; window 1 is the last key's value exactly."""
    q, k_pool, v_pool, tables, lengths = case(9, 9, 3, 64, dtype, seed=window)
    keys, values = _gather_blocks(k_pool, tables, BLOCK), _gather_blocks(v_pool, tables, BLOCK)
    key_index = torch.arange(keys.shape[1])[None]
    mask = (key_index < lengths[:, None]) & (key_index >= lengths[:, None] - window)
    expected = _decode_attention(q, keys, values, mask, 0.125)
    got = windowed(q, k_pool, v_pool, tables, lengths, window)
    assert (got - expected).abs().max().item() < 2e-6
    full = kernel(q, k_pool, v_pool, tables, lengths)
    assert torch.equal(windowed(q, k_pool, v_pool, tables, lengths, 0), full)  # 0 = no window
    for row in range(9):
        if lengths[row] <= window:
            assert torch.equal(got[row], full[row]), row
        else:
            assert not torch.allclose(got[row], full[row], atol=1e-3), row
    if window == 1:
        last = torch.stack(
            [v_pool[tables[r, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK] for r, n in enumerate(lengths)]
        )
        assert torch.equal(got, last.float().repeat_interleave(3, dim=1))


def test_windowed_rows_are_bitwise_batch_invariant(kernel_library: QuantLibrary) -> None:
    q, k_pool, v_pool, tables, lengths = case(12, 9, 3, 64, torch.float32, seed=8)
    together = windowed(q, k_pool, v_pool, tables, lengths, 20)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    assert torch.equal(windowed(q[order], k_pool, v_pool, tables[order], lengths[order], 20), together[order])
    for row in range(12):
        alone = windowed(q[row : row + 1], k_pool, v_pool, tables[row : row + 1], lengths[row : row + 1], 20)
        assert torch.equal(alone[0], together[row]), row


def capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    window: int,
    cap: float,
) -> torch.Tensor:
    return torch.ops.ifb_quant.paged_decode_attention_softcap(q, k, v, tables, lengths, BLOCK, 0.125, window, cap)


@pytest.mark.parametrize("window", [0, 20])
def test_a_softcap_bends_each_score_as_the_torch_path(kernel_library: QuantLibrary, window: int) -> None:
    """Scores s -> cap * tanh(s / cap) before the softmax (q scaled so scores reach several caps,
    where the cap changes the output by far more than rounding); cap 0 is the uncapped op, bitwise;
    rows stay bitwise batch invariant."""
    q, k_pool, v_pool, tables, lengths = case(9, 9, 3, 64, torch.float32, seed=11)
    q = q * 8
    keys, values = _gather_blocks(k_pool, tables, BLOCK), _gather_blocks(v_pool, tables, BLOCK)
    key_index = torch.arange(keys.shape[1])[None]
    mask = (key_index < lengths[:, None]) & (key_index >= lengths[:, None] - (window or keys.shape[1]))
    expected = _decode_attention(q, keys, values, mask, 0.125, softcap=5.0)
    got = capped(q, k_pool, v_pool, tables, lengths, window, 5.0)
    assert (got - expected).abs().max().item() < 4e-6
    uncapped = windowed(q, k_pool, v_pool, tables, lengths, window)
    assert torch.equal(capped(q, k_pool, v_pool, tables, lengths, window, 0.0), uncapped)
    assert (got - uncapped)[lengths > 1].abs().amax().item() > 0.05
    for row in range(9):
        alone = capped(q[row : row + 1], k_pool, v_pool, tables[row : row + 1], lengths[row : row + 1], window, 5.0)
        assert torch.equal(alone[0], got[row]), row
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        capped(q, k_pool, v_pool, tables, lengths, window, -1.0)


def test_out_of_pool_tables_and_lengths_are_refused(kernel_library: QuantLibrary) -> None:
    q, k_pool, v_pool, tables, lengths = case(2, 4, 2, 16, torch.float32, seed=6)
    bad = tables.clone()
    bad[1, 0] = SLOTS // BLOCK
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel(q, k_pool, v_pool, bad, lengths.clamp(max=BLOCK))
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        kernel(q, k_pool, v_pool, tables, lengths + 9 * BLOCK)


_OTHER_BUILD = """
import sys, torch
from pathlib import Path
from ifb.plugins.quant_build import load_quant_library
assert load_quant_library(Path(sys.argv[1]), []) == sys.argv[4]
torch.save([torch.ops.ifb_quant.paged_decode_attention(*case, 16, 0.125) for case in torch.load(sys.argv[2])], sys.argv[3])
"""


@pytest.mark.parametrize("isa", [QuantIsa.AVX2, QuantIsa.AVX512])
def test_other_isa_builds_give_the_same_bits(kernel_library: QuantLibrary, tmp_path: Path, isa: QuantIsa) -> None:
    """AVX2 (two ymm per 16-lane vector) and AVX-512 builds attend to exactly this build's bits,
    every pool dtype, q8_0 rows included: an engine's batch invariance holds on each ISA path it can be built for."""
    if isa.value == kernel_library.isa.value:
        pytest.skip(f"{isa.value} is this machine's own build")
    other = build_quant_library(tmp_path / isa.value, isa)
    if not set(other.required_features) <= cpu_features():
        pytest.skip(f"this CPU cannot run the {isa.value} path")
    cases = [
        case(5, 9, 3, 64, dtype, seed=index)
        for index, dtype in enumerate((torch.float32, torch.float16, torch.bfloat16))
    ]
    cases.append(case(4, 4, 2, 16, torch.float32, seed=7))
    for heads, kv_heads, head_dim, seed in ((9, 3, 64, 8), (4, 2, 16, 9)):  # --kv-dtype q8_0 pools
        q, k_pool, v_pool, tables, lengths = case(5, heads, kv_heads, head_dim, torch.float32, seed)
        cases.append((q, quantize_q8_0(k_pool), quantize_q8_0(v_pool), tables, lengths))
    torch.save(cases, tmp_path / "cases.pt")
    command = [
        sys.executable,
        "-c",
        _OTHER_BUILD,
        str(other.path),
        str(tmp_path / "cases.pt"),
        str(tmp_path / "out.pt"),
    ]
    result = subprocess.run([*command, isa.value], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    for index, (theirs, inputs) in enumerate(zip(torch.load(tmp_path / "out.pt"), cases, strict=True)):
        assert torch.equal(theirs, kernel(*inputs)), f"case {index}"
