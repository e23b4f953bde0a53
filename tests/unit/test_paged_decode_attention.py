"""The paged attention kernel (`ifb_quant::paged_attention`) against the compiled torch path it replaces.

Pins: for fp32, fp16 and bf16 pools, grouped heads, lengths from 1 to a full table and blocks
scattered over the pool, the kernel's output is within fp32 rounding of `_decode_attention`
over gathered K/V; a request's output is bitwise the same alone, in a batch, in another
position, and with 1 or 2 threads; a sliding window reads each row's last keys only; Gemma 2's
soft-cap bends each score as the torch path does, windowed or not; gpt-oss's sinks join each
head's softmax as the torch path's and transformers' do; the three ops engines built before the
one contract still call give its bits; AVX2 and AVX-512 builds give the same bits (q8_0 pools and
every variant field too); bad tables and variant fields are refused instead of read or guessed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from kernel_builds import KernelBuilds
from other_isa import other_isa_build, run_in_build

from ifb.plugins.attention import _decode_attention, _gather_blocks, paged_attention, paged_attention_decode_kernel
from ifb.plugins.attention_reference import paged_attention_reference
from ifb.plugins.attention_variant import AttentionVariant
from ifb.plugins.kv_format import quantize_q8_0
from ifb.plugins.layout import AttentionLayout
from ifb.plugins.quant_build import QuantIsa, QuantLibrary
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

BLOCK = 16
SLOTS = 128 * BLOCK


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    variant: str = "",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.ops.ifb_quant.paged_attention(q, k, v, tables, lengths, BLOCK, 0.125, variant, sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 16), (2, 2, 32)])
def test_matches_the_compiled_torch_path(
    quant_library: QuantLibrary, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
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
def test_rows_are_bitwise_batch_invariant(quant_library: QuantLibrary, threads: int) -> None:
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
    return kernel(q, k, v, tables, lengths, AttentionVariant(window=window or None).kernel_fields())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_a_window_reads_only_each_rows_last_keys(quant_library: QuantLibrary, dtype: torch.dtype, window: int) -> None:
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


def test_windowed_rows_are_bitwise_batch_invariant(quant_library: QuantLibrary) -> None:
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
    return kernel(
        q, k, v, tables, lengths, AttentionVariant(window=window or None, softcap=cap or None).kernel_fields()
    )


@pytest.mark.parametrize("window", [0, 20])
def test_a_softcap_bends_each_score_as_the_torch_path(quant_library: QuantLibrary, window: int) -> None:
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
        kernel(q, k_pool, v_pool, tables, lengths, f"window={window};softcap=-1.0")


def sink_logits(heads: int, seed: int) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [AttentionVariant(), AttentionVariant(window=20, softcap=5.0)])
def test_sinks_join_each_heads_softmax_as_the_torch_path(
    quant_library: QuantLibrary, dtype: torch.dtype, variant: AttentionVariant
) -> None:
    """gpt-oss: a sink logit per query head joins the max and the denominator and weights no
    value. Within rounding of the torch path (with the variant's other fields at once); a row of
    one key gives that key's value times 1 / (1 + exp(sink - score)), computed here the way
    transformers does (softmax over the scores with the sink appended, the sink's column
    dropped); a sink far below every score changes no bit; rows stay bitwise batch invariant."""
    q, k_pool, v_pool, tables, lengths = case(9, 9, 3, 64, dtype, seed=13)
    sinks = sink_logits(9, seed=3)
    keys, values = _gather_blocks(k_pool, tables, BLOCK), _gather_blocks(v_pool, tables, BLOCK)
    key_index = torch.arange(keys.shape[1])[None]
    window = variant.window or keys.shape[1]
    mask = (key_index < lengths[:, None]) & (key_index >= lengths[:, None] - window)
    expected = _decode_attention(q, keys, values, mask, 0.125, softcap=variant.softcap, sinks=sinks)
    got = kernel(q, k_pool, v_pool, tables, lengths, variant.kernel_fields(), sinks)
    assert (got - expected).abs().max().item() < 4e-6
    without = kernel(q, k_pool, v_pool, tables, lengths, variant.kernel_fields())
    assert (got - without).abs().amax().item() > 0.05  # the sinks matter far beyond rounding
    score = (q[0].reshape(3, 3, 64) * keys[0, 0].float()[:, None, :]).sum(-1).reshape(9) * 0.125
    if variant.softcap is not None:
        score = torch.tanh(score / variant.softcap) * variant.softcap
    weight = torch.softmax(torch.stack((score, sinks)), dim=0)[0]  # the key's share beside the sink
    one_key = values[0, 0].float().repeat_interleave(3, dim=0) * weight[:, None]
    assert torch.allclose(got[0], one_key, atol=2e-6)
    assert torch.equal(kernel(q, k_pool, v_pool, tables, lengths, variant.kernel_fields(), sinks - 1e4), without)
    for row in range(9):
        alone = kernel(
            q[row : row + 1],
            k_pool,
            v_pool,
            tables[row : row + 1],
            lengths[row : row + 1],
            variant.kernel_fields(),
            sinks,
        )
        assert torch.equal(alone[0], got[row]), row


def test_the_ops_before_the_contract_give_its_bits(quant_library: QuantLibrary) -> None:
    """Engines built before the one attention op call paged_decode_attention{,_window,_softcap}
    through their own shims: those ops stay, and give exactly the contract's bits."""
    q, k_pool, v_pool, tables, lengths = case(9, 9, 3, 64, torch.float16, seed=21)
    args = (q, k_pool, v_pool, tables, lengths, BLOCK, 0.125)
    ops = torch.ops.ifb_quant
    assert torch.equal(ops.paged_decode_attention(*args), kernel(q, k_pool, v_pool, tables, lengths))
    assert torch.equal(ops.paged_decode_attention_window(*args, 20), windowed(q, k_pool, v_pool, tables, lengths, 20))
    assert torch.equal(
        ops.paged_decode_attention_softcap(*args, 20, 5.0), capped(q, k_pool, v_pool, tables, lengths, 20, 5.0)
    )


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("temperature=2", "unknown attention variant field 'temperature'"),
        ("window", "is not name=value"),
        ("window=ten", "window has no number"),
        ("softcap=", "softcap has no number"),
        ("window=-3", "sliding window must be >= 0"),
    ],
)
def test_variant_fields_are_checked_by_name(quant_library: QuantLibrary, variant: str, message: str) -> None:
    q, k_pool, v_pool, tables, lengths = case(2, 4, 2, 16, torch.float32, seed=6)
    with pytest.raises(RuntimeError, match=message):
        kernel(q, k_pool, v_pool, tables, lengths, variant)


def test_sinks_of_another_shape_or_dtype_are_refused(quant_library: QuantLibrary) -> None:
    q, k_pool, v_pool, tables, lengths = case(2, 4, 2, 16, torch.float32, seed=6)
    for bad in (torch.zeros(2), torch.zeros(4, 1), torch.zeros(4, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="sinks must be float32"):
            kernel(q, k_pool, v_pool, tables, lengths, "", bad)


def mixed_step(seed: int) -> tuple[torch.Tensor, AttentionLayout]:
    """Two prompt chunks (one after a 21-token prefix) and three decode rows, blocks scattered."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(SLOTS // BLOCK, generator=generator).tolist()
    pieces = [(11, 0), (7, 21), (1, 40), (1, 3), (1, 77)]  # (query tokens, tokens before them)
    slices = []
    for tokens, start in pieces:
        needed = -(-(start + tokens) // BLOCK)
        table, blocks = blocks[:needed], blocks[needed:]
        slices.append(RequestSlice([0] * tokens, start, table, sample=True))
    inputs = build_step_inputs(slices, BLOCK)
    layout = AttentionLayout(*(getattr(inputs, f.name) for f in dataclasses.fields(AttentionLayout) if f.init))
    return inputs.positions, layout


@pytest.mark.parametrize(
    ("variant", "with_sinks"),
    [
        (AttentionVariant(), False),
        (AttentionVariant(window=9), False),
        (AttentionVariant(softcap=3.0), False),
        (AttentionVariant(), True),
        (AttentionVariant(window=9, softcap=3.0), True),
    ],
)
def test_every_path_honours_the_variant_and_sinks(
    quant_library: QuantLibrary, variant: AttentionVariant, with_sinks: bool
) -> None:
    """The contract, one meaning on every path: the torch path (SDPA or explicit scores) and the
    kernel path (prompt rows one by one) equal the per-request reference loop on a step mixing
    prompt chunks and decode rows, for each field alone and all at once."""
    positions, layout = mixed_step(seed=4)
    generator = torch.Generator().manual_seed(9)
    k_pool = torch.randn(SLOTS, 3, 64, generator=generator)
    v_pool = torch.randn(SLOTS, 3, 64, generator=generator)
    q = torch.randn(positions.shape[0], 9, 64, generator=generator) * 3
    sinks = sink_logits(9, seed=8) if with_sinks else None
    args = (q, k_pool, v_pool, positions, layout, BLOCK, 0.125, variant, sinks)
    expected = paged_attention_reference(*args)
    for path in (paged_attention, paged_attention_decode_kernel):
        got = path(*args)
        assert (got - expected).abs().max().item() < 4e-6, path.__name__
    if variant != AttentionVariant() or with_sinks:  # each field moves the output far past rounding
        plain = paged_attention_reference(q, k_pool, v_pool, positions, layout, BLOCK, 0.125)
        assert (expected - plain).abs().max().item() > 0.05


def test_variant_fields_round_trip_exactly() -> None:
    """The softcap reaches the kernel as the same double the model declared (repr round-trips)."""
    assert AttentionVariant().kernel_fields() == ""
    assert AttentionVariant(window=128, softcap=50.0).kernel_fields() == "window=128;softcap=50.0"
    assert float(AttentionVariant(softcap=0.1 + 0.2).kernel_fields().split("=")[1]) == 0.1 + 0.2
    with pytest.raises(ValueError, match="window must be a positive"):
        AttentionVariant(window=0)


def test_out_of_pool_tables_and_lengths_are_refused(quant_library: QuantLibrary) -> None:
    q, k_pool, v_pool, tables, lengths = case(2, 4, 2, 16, torch.float32, seed=6)
    bad = tables.clone()
    bad[1, 0] = SLOTS // BLOCK
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel(q, k_pool, v_pool, bad, lengths.clamp(max=BLOCK))
    with pytest.raises(RuntimeError, match="exceeds the block table"):
        kernel(q, k_pool, v_pool, tables, lengths + 9 * BLOCK)


_ATTEND = """
out = [torch.ops.ifb_quant.paged_attention(*case[:5], 16, 0.125, *case[5:]) for case in cases]
"""


@pytest.mark.parametrize("isa", [QuantIsa.AVX2, QuantIsa.AVX512])
def test_other_isa_builds_give_the_same_bits(
    quant_library: QuantLibrary, kernel_builds: KernelBuilds, tmp_path: Path, isa: QuantIsa
) -> None:
    """AVX2 (two ymm per 16-lane vector) and AVX-512 builds attend to exactly this build's bits,
    every pool dtype, q8_0 rows included, every variant field and sinks: an engine's batch invariance
    holds on each ISA path it can be built for."""
    other = other_isa_build(kernel_builds, isa)
    cases: list[tuple[object, ...]] = [
        (*case(5, 9, 3, 64, dtype, seed=index), "", None)
        for index, dtype in enumerate((torch.float32, torch.float16, torch.bfloat16))
    ]
    cases.append((*case(4, 4, 2, 16, torch.float32, seed=7), "", None))
    cases.append((*case(5, 9, 3, 64, torch.float16, seed=10), "window=20;softcap=5.0", sink_logits(9, seed=4)))
    for heads, kv_heads, head_dim, seed in ((9, 3, 64, 8), (4, 2, 16, 9)):  # --kv-dtype q8_0 pools
        q, k_pool, v_pool, tables, lengths = case(5, heads, kv_heads, head_dim, torch.float32, seed)
        cases.append((q, quantize_q8_0(k_pool), quantize_q8_0(v_pool), tables, lengths, "", None))
    for index, (theirs, inputs) in enumerate(zip(run_in_build(other, _ATTEND, cases, tmp_path), cases, strict=True)):
        assert torch.equal(theirs, kernel(*inputs)), f"case {index}"
