"""The paged attention kernel's prefill tiles: rows of one request that share a block table are
computed together (K/V loaded once per tile), each row's bits exactly decode's.

Pins: a request's query rows passed together (as the engine's context path passes a prompt
chunk) give, row for row, the bits of the same rows passed one at a time (the decode kernel), for
every pool dtype (fp32, fp16, bf16, q8_0), every variant field (window, softcap, sinks), head
dims 16 to 256 with head groups wider than a register block, row counts that are not a multiple
of the tile, a chunk after a cached prefix, with 1 or 2 threads; the rows of a step mixing
requests tile by request and still equal their rows alone; the AVX2 and AVX-512 builds give the
same tiled bits. The kernel tiles only where a KV head's group x head_dim is at least 256 (below
it rows one at a time are faster, plan_attention_tiles), so every shape here is at least that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_builds import KernelBuilds
from other_isa import other_isa_build, run_in_build

from ifb.plugins.kv_format import quantize_q8_0
from ifb.plugins.quant_build import QuantIsa, QuantLibrary

BLOCK = 16
SLOTS = 64 * BLOCK
TILE_ROWS = 8  # kAttentionTileRows in quant_kernels.h


def pools(kv_heads: int, head_dim: int, kv_dtype: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(SLOTS, kv_heads, head_dim, generator=generator)
    v = torch.randn(SLOTS, kv_heads, head_dim, generator=generator)
    if kv_dtype == "q8_0":
        return quantize_q8_0(k), quantize_q8_0(v)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[kv_dtype]
    return k.to(dtype), v.to(dtype)


def chunk(
    rows: int, cached: int, heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A request's `rows` query rows at positions cached..cached+rows-1: q, tables (the request's
    scattered blocks, one copy per row), seq_lens (position + 1)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = -(-(cached + rows) // BLOCK) + 1  # one unread block past the last key
    table = torch.randperm(SLOTS // BLOCK, generator=generator)[:blocks]
    q = torch.randn(rows, heads, head_dim, generator=generator) * 2
    return q, table[None].expand(rows, -1).contiguous(), torch.arange(cached + 1, cached + rows + 1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    variant: str = "",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.ops.ifb_quant.paged_attention(q, k, v, tables, lengths, BLOCK, 0.125, variant, sinks)


def one_at_a_time(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    variant: str = "",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row as its own call: a one-row item, the decode kernel."""
    rows = [
        attend(q[r : r + 1], k, v, tables[r : r + 1], lengths[r : r + 1], variant, sinks) for r in range(q.shape[0])
    ]
    return torch.cat(rows)


def sink_logits(heads: int, seed: int) -> torch.Tensor:
    return torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2


VARIANTS = [("", False), ("window=37", False), ("softcap=5.0", False), ("", True), ("window=20;softcap=3.0", True)]


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16", "q8_0"])
@pytest.mark.parametrize(("variant", "with_sinks"), VARIANTS)
def test_tiled_rows_are_decode_rows_bitwise(
    quant_library: QuantLibrary, kv_dtype: str, variant: str, with_sinks: bool
) -> None:
    """A 29-row chunk (not a multiple of the tile) after 70 cached tokens (not a multiple of a
    block or of 16 lanes): every row the bits it has alone, each pool dtype and variant field."""
    k, v = pools(2, 64, kv_dtype, seed=1)
    q, tables, lengths = chunk(29, 70, 8, 64, seed=2)
    sinks = sink_logits(8, seed=3) if with_sinks else None
    together = attend(q, k, v, tables, lengths, variant, sinks)
    assert torch.equal(together, one_at_a_time(q, k, v, tables, lengths, variant, sinks))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(32, 2, 16), (16, 2, 32), (6, 2, 128), (3, 1, 256)])
@pytest.mark.parametrize("kv_dtype", ["fp32", "q8_0"])
def test_every_head_dim_tiles_bitwise(
    quant_library: QuantLibrary, heads: int, kv_heads: int, head_dim: int, kv_dtype: str
) -> None:
    """Head dims 16..256, with head groups wider than one register block (16 heads of 16 or 8 of
    32: blocks of 16 and 8; 3 heads of 128 or 256: blocks of 2 and 1), a fresh prompt of 19 rows:
    row for row the decode bits."""
    k, v = pools(kv_heads, head_dim, kv_dtype, seed=head_dim)
    q, tables, lengths = chunk(19, 0, heads, head_dim, seed=head_dim + 1)
    assert torch.equal(attend(q, k, v, tables, lengths), one_at_a_time(q, k, v, tables, lengths))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunk_splits_anywhere_with_the_same_bits(quant_library: QuantLibrary, threads: int) -> None:
    """A 45-token prompt whole, or as chunks 0..12, 13..44 (tiles start at other rows), or with
    the first 20 rows cached: each row's bits depend on nothing but its own query and keys."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k, v = pools(2, 64, "fp16", seed=5)
        q, tables, lengths = chunk(45, 0, 8, 64, seed=6)
        whole = attend(q, k, v, tables, lengths, "window=23")
        for split in (13, 20):
            first = attend(q[:split], k, v, tables[:split], lengths[:split], "window=23")
            rest = attend(q[split:], k, v, tables[split:], lengths[split:], "window=23")
            assert torch.equal(torch.cat([first, rest]), whole), split
    finally:
        torch.set_num_threads(before)


def test_a_mixed_step_tiles_by_request(quant_library: QuantLibrary) -> None:
    """Two requests' chunks (11 rows fresh, 20 rows after 33 cached) around three decode rows, in
    one call as the engine makes it: tiles end where the block table changes, and every row
    still has its bits alone."""
    k, v = pools(2, 64, "bf16", seed=7)
    a_q, a_tables, a_lengths = chunk(11, 0, 8, 64, seed=8)
    b_q, b_tables, b_lengths = chunk(20, 33, 8, 64, seed=9)
    d_q, d_tables, d_lengths = chunk(3, 50, 8, 64, seed=10)
    d_tables[1, 0] = (d_tables[1, 0] + 1) % (SLOTS // BLOCK)  # three requests' decode rows
    d_tables[2, 1] = (d_tables[2, 1] + 1) % (SLOTS // BLOCK)
    width = max(t.shape[1] for t in (a_tables, b_tables, d_tables))
    tables = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in (a_tables, d_tables, b_tables)])
    q, lengths = torch.cat([a_q, d_q, b_q]), torch.cat([a_lengths, d_lengths, b_lengths])
    assert torch.equal(attend(q, k, v, tables, lengths), one_at_a_time(q, k, v, tables, lengths))


def test_tiled_rows_match_the_softmax_of_their_own_keys(quant_library: QuantLibrary) -> None:
    """Not only decode's bits but the right answer: each causal row is softmax(q K^T) V over its
    own keys, within fp32 rounding (float64 reference)."""
    k, v = pools(2, 32, "fp32", seed=11)
    q, tables, lengths = chunk(17, 5, 16, 32, seed=12)
    got = attend(q, k, v, tables, lengths)
    slots = (tables[0][:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    keys, values = k[slots].double(), v[slots].double()
    for r in range(17):
        n = int(lengths[r])
        for h in range(16):
            weights = torch.softmax((keys[:n, h // 8] @ q[r, h].double()) * 0.125, dim=0)
            assert torch.allclose(got[r, h].double(), weights @ values[:n, h // 8], atol=2e-6), (r, h)


_ATTEND = """
out = [torch.ops.ifb_quant.paged_attention(*case[:5], 16, 0.125, *case[5:]) for case in cases]
"""


@pytest.mark.parametrize("isa", [QuantIsa.AVX2, QuantIsa.AVX512])
def test_other_isa_builds_tile_to_the_same_bits(
    quant_library: QuantLibrary, kernel_builds: KernelBuilds, tmp_path: Path, isa: QuantIsa
) -> None:
    """AVX2 and AVX-512 builds give this build's bits for tiled rows, each pool dtype and the
    variant fields together."""
    other = other_isa_build(kernel_builds, isa)
    cases: list[tuple[object, ...]] = []
    for index, kv_dtype in enumerate(("fp32", "fp16", "bf16", "q8_0")):
        k, v = pools(2, 64, kv_dtype, seed=20 + index)
        q, tables, lengths = chunk(21, 40, 8, 64, seed=30 + index)
        variant, sinks = ("window=20;softcap=5.0", sink_logits(8, index)) if index % 2 else ("", None)
        cases.append((q, k, v, tables, lengths, variant, sinks))
    for index, (theirs, inputs) in enumerate(zip(run_in_build(other, _ATTEND, cases, tmp_path), cases, strict=True)):
        assert torch.equal(theirs, attend(*inputs)), f"case {index}"
