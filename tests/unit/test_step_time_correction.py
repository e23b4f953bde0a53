"""The online correction of the step cost model: a server whose chunked steps run over the
build-time model learns the ratio, and the target budgets then keep the real step under target."""

from __future__ import annotations

import pytest
from fakes import FakeEngine, make_request, make_scheduler

from ifb.runtime.scheduler import Scheduler
from ifb.runtime.step_budget.budgets import (
    DEFAULT_TARGET_DECODE_MULTIPLE,
    DEFAULT_TARGET_FLOOR_MS,
    FixedBudget,
    StepBudget,
    make_step_budget,
)
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape
from ifb.runtime.step_budget.time_correction import MAX_RATIO, MIN_RATIO, StepTimeCorrection

BLOCK = 16
MODEL = StepCostModel(30.0, 1.8, 1.5, 0.002, 0.0001)  # what the build measured
# This server: every term 25% dearer (sampling, delivery and server threads on the same cores).
LOADED = StepCostModel(*(1.25 * c for c in MODEL.coefficients))


def test_first_observation_replaces_the_prior_then_smooths() -> None:
    correction = StepTimeCorrection(smoothing=0.1)
    assert correction.ratio == 1.0
    correction.observe(100.0, 120.0)
    assert correction.ratio == pytest.approx(1.2)
    correction.observe(100.0, 220.0)  # clamped to MAX_RATIO first
    assert correction.ratio == pytest.approx(1.2 + 0.1 * (MAX_RATIO - 1.2))
    correction.observe(0.0, 50.0)  # nothing to learn from a zero prediction
    correction.observe(100.0, 1.0)
    assert correction.ratio == pytest.approx(1.28 + 0.1 * (MIN_RATIO - 1.28))


def scheduler_with(budget: StepBudget) -> Scheduler:
    return make_scheduler(
        num_blocks=1024, block_size=BLOCK, max_batch_size=16, max_num_tokens=512, max_seq_len=2048, budget=budget
    )


def real_target_ms(budget: StepBudget, shape: StepShape) -> float | None:
    """The real-time bound a step of `shape` was sized for (None: no decodes, no bound)."""
    target = budget.report().itl_target_ms
    if target is not None:
        return target
    if shape.num_decode_rows == 0:
        return None
    decode = StepShape(num_decode_rows=shape.num_decode_rows, num_decode_context_tokens=shape.num_decode_context_tokens)
    return max(DEFAULT_TARGET_FLOOR_MS, DEFAULT_TARGET_DECODE_MULTIPLE * MODEL.predict_ms(decode))


def worst_overshoot(target_ms: float | None, correct: bool) -> float:
    """8 streams decoding while a 400-token prompt arrives every 4 steps; the worst real (LOADED)
    time / target of the chunked steps after the first 5 (the correction's warm-up)."""
    budget = make_step_budget(target_ms, MODEL, max_batch_size=16, block_size=BLOCK)
    engine = FakeEngine(scheduler_with(budget), LOADED)
    for _ in range(8):
        engine.scheduler.add(make_request(20, 300))
    ratios = []
    for step in range(160):
        if step % 4 == 0 and step < 120:
            engine.scheduler.add(make_request(400, 4))
        batch = engine.step()
        real_ms = engine.step_ms[-1]
        if correct and batch.predicted_ms is not None:
            budget.observe_step(batch.predicted_ms, real_ms, batch.has_prefill_chunk)
        target = real_target_ms(budget, engine.shapes[-1])
        if batch.has_prefill_chunk and target is not None:
            ratios.append(real_ms / target)
    assert len(ratios) > 20
    return max(ratios[5:])


@pytest.mark.parametrize("target_ms", [None, 200.0])
def test_learned_ratio_keeps_real_chunked_steps_under_the_target(target_ms: float | None) -> None:
    """Uncorrected, chunked steps land ~25% over the target; corrected, the ratio converges to
    1.25 and every chunked step past the first few stays within it. None = the default relative
    target (2.5x the step's predicted decode time, >= 100 ms)."""
    assert worst_overshoot(target_ms, correct=False) > 1.15
    assert worst_overshoot(target_ms, correct=True) <= 1.0 + 1e-9
    budget = make_step_budget(target_ms, MODEL, max_batch_size=16, block_size=BLOCK)
    budget.observe_step(100.0, 125.0, has_prefill=True)
    assert budget.report().measured_over_predicted == pytest.approx(1.25)


def test_decode_only_steps_and_the_fixed_budget_learn_nothing() -> None:
    budget = make_step_budget(200.0, MODEL, max_batch_size=16, block_size=BLOCK)
    budget.observe_step(50.0, 90.0, has_prefill=False)
    assert budget.report().measured_over_predicted == 1.0
    fixed = FixedBudget(MODEL)
    fixed.observe_step(50.0, 90.0, has_prefill=True)
    assert fixed.report().measured_over_predicted is None
