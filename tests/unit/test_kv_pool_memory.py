"""The KV pool's memory: resident only where written (step/kv_pool.py), and calibration writes a
bounded part of it (step_budget/calibration.py), so neither a build nor an idle server holds a
full-load pool."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import psutil
import pytest
import torch
from engine_records import SPEC, engine_config

from ifb.builder.errors import LimitsError
from ifb.builder.limits import resolve_limits
from ifb.runtime.engine_format import EngineLimits, kv_bytes_per_block
from ifb.runtime.step.kv_pool import engine_kv_pool, zeroed_pool
from ifb.runtime.step_budget.calibration import (
    KV_CALIBRATION_BYTES,
    calibration_blocks,
    calibration_points,
    point_slices,
)

POOL_BYTES = 512 * 2**20


def resident_bytes() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_pool_reads_as_zeros_and_keeps_what_is_written(dtype: torch.dtype) -> None:
    pool = zeroed_pool((2, 2, 40, 3, 8), dtype)
    assert pool.shape == (2, 2, 40, 3, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    views = [pool[layer, kind] for layer in range(2) for kind in range(2)]
    views[3].index_copy_(0, torch.tensor([5, 39]), torch.ones(2, 3, 8, dtype=dtype))
    assert pool[1, 1, 5].eq(1).all() and pool[1, 1, 39].eq(1).all()
    assert int(pool.ne(0).sum()) == 2 * 3 * 8


def test_a_pool_is_resident_only_where_written() -> None:
    before = resident_bytes()
    pool = zeroed_pool((POOL_BYTES // 4,), torch.float32)
    allocated = resident_bytes()
    assert allocated - before < 32 * 2**20, "a fresh pool must not be resident"
    pool[: pool.numel() // 4].fill_(1.0)  # a quarter of it written
    written = resident_bytes()
    assert 0.8 * POOL_BYTES / 4 < written - allocated < 1.2 * POOL_BYTES / 4
    del pool


def engine_with(num_kv_blocks: int, spec_changes: dict[str, int]) -> SimpleNamespace:
    """What calibration reads of an engine: its config (B=16, 512 tokens a step, 2048 a sequence)."""
    limits = EngineLimits(
        max_batch_size=16, max_num_tokens=512, max_seq_len=2048, block_size=16, num_kv_blocks=num_kv_blocks
    )
    return SimpleNamespace(config=engine_config(spec=replace(SPEC, **spec_changes), limits=limits))


EIGHT_B_KV = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}  # 256 KiB of fp32 KV a token


def test_calibration_writes_at_most_its_bound_of_a_large_pool() -> None:
    engine = engine_with(4096, EIGHT_B_KV)  # 16 GiB of fp32 KV
    block_bytes = kv_bytes_per_block(engine.config.spec, 16, "float32")
    assert 4096 * block_bytes > 8 * KV_CALIBRATION_BYTES
    assert calibration_blocks(engine) * block_bytes <= KV_CALIBRATION_BYTES
    used: set[int] = set()
    for point in calibration_points(engine):
        slices = point_slices(engine, point)
        for request in slices:
            used.update(request.block_table)
        decode_ids = [block for s in slices if len(s.token_ids) == 1 for block in s.block_table]
        assert len(decode_ids) == len(set(decode_ids)), f"{point}: decode rows share KV blocks"
    assert max(used) < calibration_blocks(engine)
    assert len(used) * block_bytes <= KV_CALIBRATION_BYTES
    # the full batch still reads a context of several blocks per row, from distinct memory
    assert max(p.decode_context for p in calibration_points(engine) if p.num_decode_rows == 16) >= 8 * 16


def test_a_pool_within_the_bound_calibrates_the_full_depth() -> None:
    engine = engine_with(4096, {})  # the tiny KV shape: the whole pool is far below the bound
    assert calibration_blocks(engine) == 4096
    contexts = {(p.num_decode_rows, p.decode_context) for p in calibration_points(engine) if p.num_decode_rows}
    assert contexts == {(rows, context) for rows in (1, 4, 16) for context in (16, 1024)}


def test_kv_memory_holds_about_twice_fp16s_blocks_in_q8_0() -> None:
    """`--kv-memory` sizes the pool in the format's real bytes: at head_dim 128 a q8_0 head is
    136 bytes against fp16's 256, so the same 2 GB hold 1.88x the blocks (fp32: half of fp16's)."""
    spec = replace(SPEC, **EIGHT_B_KV)
    sizes = {
        kv_dtype: resolve_limits(
            spec,
            max_batch_size=8,
            max_num_tokens=64,
            max_seq_len=256,
            block_size=16,
            kv_dtype=kv_dtype,
            kv_memory_gb=2.0,
        ).num_kv_blocks
        for kv_dtype in ("float32", "float16", "q8_0")
    }
    assert sizes["q8_0"] == int(2e9 // kv_bytes_per_block(spec, 16, "q8_0")) == int(2e9 // (2 * 32 * 16 * 8 * 136))
    assert sizes["q8_0"] / sizes["float16"] == pytest.approx(256 / 136, rel=1e-3)
    assert sizes["float16"] // 2 == sizes["float32"]  # (953 and 476: whole blocks)


def test_a_q8_0_pool_is_uint8_rows_of_each_heads_bytes() -> None:
    """engine_kv_pool turns kv_dtype into the tensor: [layers, K/V, slots, kv_heads, row bytes]."""
    spec = replace(SPEC, **EIGHT_B_KV)
    limits = EngineLimits(max_batch_size=1, max_num_tokens=16, max_seq_len=32, block_size=16, num_kv_blocks=4)
    pool = engine_kv_pool(spec, limits, "q8_0")
    assert pool.dtype == torch.uint8 and pool.shape == (32, 2, 64, 8, 136) and not pool.any()
    assert pool.nbytes == 4 * kv_bytes_per_block(spec, 16, "q8_0")
    assert engine_kv_pool(spec, limits, "float16").nbytes == 4 * kv_bytes_per_block(spec, 16, "float16")


def test_q8_0_refuses_a_head_dim_it_cannot_block() -> None:
    with pytest.raises(LimitsError, match="--kv-dtype q8_0 needs head_dim 16 or a multiple of 32, got head_dim 80"):
        resolve_limits(
            replace(SPEC, head_dim=80),
            max_batch_size=1,
            max_num_tokens=16,
            max_seq_len=32,
            block_size=16,
            kv_dtype="q8_0",
        )
