"""Calibration: time a handful of engine steps of known shape and fit the StepCostModel.

Run by `ifb build` at the end of a build (builder/calibrate.py), by `ifb run --calibrate` at
start, on the executor's own engine and thread before its loop starts (runtime/llm.py), and one
step at a time in the server's idle turns where no fit is stored (idle_calibration.py, which lends
the points their KV blocks from the scheduler's pool). The points span the engine's limits: decode-only
steps (few / all rows, short / long context), prefill-only chunks (small / full, at the start
and deep into a prompt) and a mixed step. The KV it writes is garbage over blocks nobody owns
yet, so it must run before any request does.

The points touch at most `KV_CALIBRATION_BYTES` of the pool (whose pages become resident only
where written, step/kv_pool.py): a build's memory must not grow with the KV pool it bakes in, and
the pool of a full-size engine is gigabytes. A decode point whose rows would read more than that
reads shorter contexts instead, each row its own blocks, so every timed KV read still comes from
distinct memory; the fit is linear in context tokens and carries the slope to longer contexts.

A mixture of experts is fitted with its expert term (expert_reads.py): the points are the same,
with decode steps at more batch sizes so that the distinct experts they read (which saturate at
E, unlike rows) are told apart from the rows. The distinct tokens of the points route like text,
not like one token repeated: every row and prefill token has its own id (as they always had).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

from ifb.runtime.engine_format import kv_bytes_per_block
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape
from ifb.runtime.step_budget.expert_reads import ExpertRouting

logger = logging.getLogger(__name__)

# Repeats per point: the median of many for small steps, which are cheap and which another
# process on a shared 2-core machine slows at random (tiny engine, 5 repeats, load ~2: one fit
# put the prefill-token cost at 0); two for a ~1 s full-size prefill (SmolLM2 fp32), so a
# calibration stays near 15 s on a quiet machine (77 s measured at load 4-5, every step ~5x slower).
MIN_REPEATS = 2
MAX_REPEATS = 25
POINT_BUDGET_S = 0.5
NOISY_FIT = 0.5  # worst relative error of the fit above which the log says so
# 512 MiB: far past any last-level cache (32 MiB per EPYC CCD, 105 MiB on a Sapphire Rapids
# socket), so context reads are timed from DRAM as when serving; well inside a build's budget of
# the model's own bytes + 1.5 GB (a 1B Llama's fp32 pool for 8192 tokens alone is 512 MiB).
KV_CALIBRATION_BYTES = 512 * 2**20


@dataclass(frozen=True, slots=True)
class CalibrationPoint:
    """One timed step: a prefill chunk of `num_prefill_tokens` after `prefill_start` cached
    tokens, beside `num_decode_rows` decodes that each read `decode_context` tokens."""

    num_prefill_tokens: int = 0
    prefill_start: int = 0
    num_decode_rows: int = 0
    decode_context: int = 0

    @property
    def shape(self) -> StepShape:
        return StepShape(
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_rows=self.num_decode_rows,
            num_decode_context_tokens=self.num_decode_rows * self.decode_context,
            num_prefill_pairs=StepShape.prefill_pairs(self.prefill_start, self.num_prefill_tokens),
        )


def calibration_points(engine: Engine, max_blocks: int | None = None) -> list[CalibrationPoint]:
    """About a dozen shapes inside the engine's limits (see the module docstring), reading at
    most `max_blocks` distinct KV blocks (default: calibration_blocks)."""
    limits = engine.config.limits
    tokens, batch, block = limits.max_num_tokens, limits.max_batch_size, limits.block_size
    short = block
    deep = max(block, min(limits.max_seq_len // 2, limits.max_seq_len - tokens) // block * block)
    chunks = sorted({max(2, tokens // 8), max(2, tokens // 2), tokens})
    rows = sorted({1, max(1, batch // 4), batch} | set(expert_rows(engine_routing(engine), batch)))
    blocks = calibration_blocks(engine, max_blocks)
    points = [
        CalibrationPoint(num_decode_rows=d, decode_context=min(c, max(block, blocks // d * block)))
        for d in rows
        for c in (short, deep)
    ]
    points += [CalibrationPoint(num_prefill_tokens=p) for p in chunks]
    points += [CalibrationPoint(num_prefill_tokens=p, prefill_start=deep) for p in chunks[:2]]
    mixed = max(2, tokens - batch)
    points.append(CalibrationPoint(num_prefill_tokens=mixed, num_decode_rows=batch, decode_context=short))
    return [p for p in points if p.prefill_start + p.num_prefill_tokens <= limits.max_seq_len]


def engine_routing(engine: Engine) -> ExpertRouting:
    """The engine's experts (ExpertRouting(): a dense engine)."""
    spec = engine.config.spec
    return ExpertRouting(spec.num_experts, spec.num_experts_per_tok)


def expert_rows(routing: ExpertRouting, batch: int) -> list[int]:
    """Decode batch sizes, beyond 1, batch/4 and batch, at which the expected distinct experts
    still grow (2, 4, 8, ... up to where they reach ~90% of E): where the rows-only line and
    the expert curve part; none for a dense engine."""
    sizes: list[int] = []
    size = 2
    while routing.is_moe and size < batch and routing.expected_distinct(size) < 0.9 * routing.num_experts:
        sizes.append(size)
        size *= 2
    return sizes


def calibration_blocks(engine: Engine, max_blocks: int | None = None) -> int:
    """How many KV blocks calibration may write: the pool (or `max_blocks` of it), up to
    KV_CALIBRATION_BYTES."""
    config = engine.config
    block_bytes = kv_bytes_per_block(config.spec, config.limits.block_size, config.kv_dtype)
    pool = config.limits.num_kv_blocks if max_blocks is None else min(max_blocks, config.limits.num_kv_blocks)
    return max(1, min(pool, KV_CALIBRATION_BYTES // block_bytes))


def point_slices(engine: Engine, point: CalibrationPoint, max_blocks: int | None = None) -> list[RequestSlice]:
    """The point's step as request slices over block ids 0..calibration_blocks-1, which wrap around
    the calibration's part of the pool: distinct where it allows, so decodes read distinct KV."""
    limits = engine.config.limits
    vocab = engine.config.spec.vocab_size
    blocks = calibration_blocks(engine, max_blocks)
    next_block = 0

    def table(num_tokens: int) -> list[int]:
        nonlocal next_block
        count = -(-num_tokens // limits.block_size)
        ids = [(next_block + i) % blocks for i in range(count)]
        next_block += count
        return ids

    slices = []
    if point.num_prefill_tokens:
        end = point.prefill_start + point.num_prefill_tokens
        ids = [(7 * i + 3) % vocab for i in range(point.num_prefill_tokens)]
        slices.append(RequestSlice(ids, point.prefill_start, table(end), True))
    for row in range(point.num_decode_rows):
        slices.append(
            RequestSlice([(11 * row + 5) % vocab], point.decode_context - 1, table(point.decode_context), True)
        )
    return slices


def time_step_ms(engine: Engine, point: CalibrationPoint) -> float:
    """Median of a few runs of one step (after one untimed run of the same shape)."""
    inputs = build_step_inputs(point_slices(engine, point), engine.config.limits.block_size)
    engine.step(inputs)
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < MAX_REPEATS and (len(times) < MIN_REPEATS or time.perf_counter() - started < POINT_BUDGET_S):
        begin = time.perf_counter()
        engine.step(inputs)
        times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def calibrate(engine: Engine) -> StepCostModel:
    """Time `calibration_points(engine)` and fit the cost model to them."""
    started = time.perf_counter()
    samples = [(point.shape, time_step_ms(engine, point)) for point in calibration_points(engine)]
    return fit_samples(engine, samples, time.perf_counter() - started)


def fit_samples(engine: Engine, samples: list[tuple[StepShape, float]], seconds: float) -> StepCostModel:
    """The cost model of the timed points, logged (and a warning where it fits badly)."""
    model = StepCostModel.fit(samples, engine_routing(engine))
    if model.max_relative_error > NOISY_FIT:
        logger.warning(
            "the step cost model fits one calibration step only within %.0f%%: was the machine busy? "
            "recalibrate with `ifb run --calibrate` when it is quiet",
            100 * model.max_relative_error,
        )
    logger.info(
        "calibrated the step cost in %.1f s over %d shapes: %.2f ms + %.4f ms/prefill token + %.3f ms/decode row "
        "+ %.3f ms/expert read (worst fit error %.0f%%)",
        seconds,
        len(samples),
        model.base_ms,
        model.per_prefill_token_ms,
        model.per_decode_row_ms,
        model.per_expert_ms,
        100 * model.max_relative_error,
    )
    return model
