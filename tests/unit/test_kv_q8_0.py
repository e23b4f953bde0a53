"""`--kv-dtype q8_0`'s row format (plugins/kv_format.py) and the decode kernel reading it.

Pins: a row is head_dim int8 then one fp16 scale per 32 values (per 16 at head_dim 16), the
values read back are exactly a float64 reference's q * d and within half a step of the input;
a token's row depends on that token alone; the kernel over q8_0 pools equals the torch path over
the same rows dequantized, and its rows are bitwise batch invariant; the pool's byte count; a
q8_0 block round-trips through the prefix disk tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ifb.plugins.attention import _decode_attention, _gather_blocks
from ifb.plugins.kv_format import dequantize_q8_0, q8_0_head_dim, quantize_q8_0
from ifb.plugins.quant_build import QuantLibrary
from ifb.runtime.engine_format import KV_Q8_0, kv_format_error, kv_row_bytes
from ifb.runtime.prefix_disk_tier import PrefixDiskTier, PrefixDiskTierConfig

BLOCK = 16
SLOTS = 64 * BLOCK


def reference_q8_0(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 in float64: d = max|x| / 127 stored as fp16, q = round(x / d) -> (q, d, q * d)."""
    blocks = x.double().reshape(*x.shape[:-1], -1, block)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().double()
    q = torch.where(d == 0, 0.0, blocks / d).round().clamp(-127, 127)
    return q, d, (q * d).reshape(x.shape)


@pytest.mark.parametrize(("head_dim", "block"), [(16, 16), (64, 32), (128, 32)])
def test_round_trip_matches_a_float64_reference(head_dim: int, block: int) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    # magnitudes 1e-2..1e3: d stays a normal fp16 (below max|x| ~ 0.008 it is subnormal and coarser, as llama.cpp's)
    x = torch.randn(50, 3, head_dim, generator=generator) * torch.logspace(-2, 3, 50)[:, None, None]
    x[0, 0] = 0  # an all-zero head: d = 0, q = 0, read back as zeros (no 0 / 0)
    rows = quantize_q8_0(x)
    assert rows.dtype == torch.uint8 and rows.shape == (50, 3, kv_row_bytes(head_dim, KV_Q8_0))
    assert rows.shape[-1] == head_dim + 2 * head_dim // block
    q, d, expected = reference_q8_0(x, block)
    # the layout: the int8 values, then the fp16 scales, each block's in order
    assert torch.equal(rows[..., :head_dim].view(torch.int8).double(), q.reshape(x.shape))
    assert torch.equal(rows[..., head_dim:].contiguous().view(torch.float16).double(), d.squeeze(-1))
    got = dequantize_q8_0(rows)
    assert got.dtype == torch.float32 and torch.equal(got.double(), expected)  # q * d is exact in fp32
    assert torch.equal(got[0, 0], torch.zeros(head_dim))
    # within half a step of each block, or the clamp's loss where fp16 rounded d down (< 2^-11 of max|x|)
    error = (got.double() - x.double()).reshape(*x.shape[:-1], -1, block).abs().amax(-1)
    peak = x.double().reshape(*x.shape[:-1], -1, block).abs().amax(-1)
    assert (error <= torch.maximum(d.squeeze(-1) * 0.5, peak * 2**-11)).all()
    assert error.max() > 0  # it is lossy: a test of nothing would pass with any identity


def test_a_tokens_row_depends_on_that_token_alone() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2, 64, generator=generator)
    together = quantize_q8_0(x)
    assert all(torch.equal(quantize_q8_0(x[i : i + 1]), together[i : i + 1]) for i in range(9))


def test_head_dims_q8_0_cannot_hold_are_named() -> None:
    assert kv_format_error(64, KV_Q8_0) is None and kv_format_error(16, KV_Q8_0) is None
    assert kv_format_error(80, "float16") is None
    assert "head_dim 80" in (kv_format_error(80, KV_Q8_0) or "")
    assert [q8_0_head_dim(kv_row_bytes(d, KV_Q8_0)) for d in (16, 32, 64, 96, 128, 256)] == [16, 32, 64, 96, 128, 256]
    with pytest.raises(ValueError, match="no q8_0 row"):
        q8_0_head_dim(64)


def test_q8_0_rows_take_about_half_of_fp16s_bytes() -> None:
    """head_dim 64: 68 bytes a head against fp16's 128 (0.53); head_dim 128: 136 against 256."""
    assert kv_row_bytes(64, KV_Q8_0) / kv_row_bytes(64, "float16") == 68 / 128
    assert kv_row_bytes(128, KV_Q8_0) / kv_row_bytes(128, "float16") == 136 / 256


def q8_0_case(rows: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    k_pool = quantize_q8_0(torch.randn(SLOTS, kv_heads, head_dim, generator=generator))
    v_pool = quantize_q8_0(torch.randn(SLOTS, kv_heads, head_dim, generator=generator))
    q = torch.randn(rows, heads, head_dim, generator=generator) * 2
    tables = torch.randperm(SLOTS // BLOCK, generator=generator)[: rows * 6].reshape(rows, 6)
    lengths = torch.randint(1, 6 * BLOCK + 1, (rows,), generator=generator)
    lengths[0], lengths[-1] = 1, 6 * BLOCK
    return q, k_pool, v_pool, tables, lengths


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (2, 1, 128)])
def test_kernel_reads_q8_0_pools_as_the_torch_path(
    quant_library: QuantLibrary, heads: int, kv_heads: int, head_dim: int
) -> None:
    """The kernel dequantizes each row as it loads it; the torch path dequantizes the gathered
    blocks: the same values, so the outputs differ by fp32 summation order only (< 2e-6, as
    the float pools' test)."""
    q, k_pool, v_pool, tables, lengths = q8_0_case(7, heads, kv_heads, head_dim, seed=heads + head_dim)
    keys, values = _gather_blocks(k_pool, tables, BLOCK), _gather_blocks(v_pool, tables, BLOCK)
    assert keys.dtype == torch.float32 and keys.shape[-1] == head_dim
    mask = torch.arange(keys.shape[1])[None] < lengths[:, None]
    expected = _decode_attention(q, keys, values, mask, 0.125)
    got = torch.ops.ifb_quant.paged_decode_attention(q, k_pool, v_pool, tables, lengths, BLOCK, 0.125)
    assert (got - expected).abs().max().item() < 2e-6
    one_value = dequantize_q8_0(v_pool[tables[0, 0] * BLOCK]).repeat_interleave(heads // kv_heads, dim=0)
    assert torch.equal(got[0], one_value)  # a single key: softmax weight 1, the row's exact values


def test_kernel_rows_over_q8_0_are_bitwise_batch_invariant(quant_library: QuantLibrary) -> None:
    q, k_pool, v_pool, tables, lengths = q8_0_case(10, 9, 3, 64, seed=5)
    together = torch.ops.ifb_quant.paged_decode_attention(q, k_pool, v_pool, tables, lengths, BLOCK, 0.125)
    for row in range(10):
        alone = torch.ops.ifb_quant.paged_decode_attention(
            q[row : row + 1], k_pool, v_pool, tables[row : row + 1], lengths[row : row + 1], BLOCK, 0.125
        )
        assert torch.equal(alone[0], together[row])


def test_kernel_refuses_a_q8_0_pool_of_the_wrong_width(quant_library: QuantLibrary) -> None:
    q, k_pool, v_pool, tables, lengths = q8_0_case(2, 4, 2, 64, seed=1)
    with pytest.raises(RuntimeError, match="must match the pools' rows"):
        torch.ops.ifb_quant.paged_decode_attention(
            q[..., :32].contiguous(), k_pool, v_pool, tables, lengths, BLOCK, 0.1
        )


def test_q8_0_blocks_round_trip_through_the_disk_tier(tmp_path: Path) -> None:
    """The prefix disk tier moves a block's rows as bytes: a q8_0 block comes back byte for byte
    into another block of a fresh pool (as after a restart), and reads back the same values."""
    spec_shape = (2, 2, 4 * BLOCK, 2)  # layers, K/V, slots, kv_heads
    pool = quantize_q8_0(torch.randn(*spec_shape, 64, generator=torch.Generator().manual_seed(2)))
    config = PrefixDiskTierConfig(tmp_path / "tier", max_bytes=10**6)
    tier = PrefixDiskTier(config, "build-q8", pool, BLOCK)
    tier.spill(b"k" * 32, 1, wait=True)
    tier.close()
    restored = torch.zeros_like(pool)
    tier = PrefixDiskTier(config, "build-q8", restored, BLOCK)
    assert tier.restore(b"k" * 32, 3)
    tier.close()
    assert torch.equal(restored[:, :, 3 * BLOCK : 4 * BLOCK], pool[:, :, BLOCK : 2 * BLOCK])
    assert torch.equal(dequantize_q8_0(restored[:, :, 3 * BLOCK]), dequantize_q8_0(pool[:, :, BLOCK]))
    assert not restored[:, :, : 3 * BLOCK].any()
