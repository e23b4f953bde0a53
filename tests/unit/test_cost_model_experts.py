"""The step cost model of a mixture of experts: steps priced by the distinct experts their rows read
(runtime/step_budget/expert_reads.py), fitted beside the dense terms; dense models unchanged.

The fit tests time nothing: the steps' "measured" times come from a known MoE cost (a base, per-row
and per-expert terms, with a few percent of noise), at the shapes calibration times, so the fitted
model is checked against the truth it was drawn from, not against this machine's speed.
"""

from __future__ import annotations

import random

import pytest

from ifb.runtime.step_budget.calibration import expert_rows
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape
from ifb.runtime.step_budget.expert_reads import ExpertRouting

QWEN3_30B = ExpertRouting(128, 8)  # Qwen3-30B-A3B: 128 experts, 8 per token
# A step of a 30B-A3B-shaped engine: 4 ms of attention and dense weights, 0.6 ms per expert read
# (its 3 matrices in all layers), little per row beyond that: decode is expert-read bound.
TRUTH = StepCostModel(4.0, 0.05, 0.05, 0.0005, 1e-6, per_expert_ms=0.6, routing=QWEN3_30B)
DENSE_FIELDS = {
    "base_ms",
    "per_prefill_token_ms",
    "per_decode_row_ms",
    "per_decode_context_ms",
    "per_prefill_pair_ms",
    "max_relative_error",
}


def timed_steps(noise: float, seed: int) -> list[tuple[StepShape, float]]:
    """Decode steps at the batch sizes calibration times for a 32-seat MoE engine (1, 8 = 32/4, 32,
    and expert_rows' 2, 4, 8, 16), short and long context, and three prefill chunks."""
    rng = random.Random(seed)
    shapes = [StepShape(0, rows, rows * context, 0) for rows in (1, 2, 4, 8, 16, 32) for context in (16, 512)]
    shapes += [StepShape(p, 0, 0, StepShape.prefill_pairs(0, p)) for p in (8, 64, 128)]
    return [(shape, TRUTH.predict_ms(shape) * (1 + rng.uniform(-noise, noise))) for shape in shapes]


def test_expected_distinct_experts_is_uniform_routings_mean() -> None:
    """k at one row, E in the limit, and the mean of seeded uniform top-k routings within 2%."""
    assert QWEN3_30B.expected_distinct(0) == 0.0
    assert QWEN3_30B.expected_distinct(1) == pytest.approx(8.0)
    assert QWEN3_30B.expected_distinct(10_000) == pytest.approx(128.0)
    assert ExpertRouting().expected_distinct(16) == 0.0  # dense: no expert reads
    rng = random.Random(0)
    for rows in (2, 4, 16, 64):
        trials = [len({e for _ in range(rows) for e in rng.sample(range(128), 8)}) for _ in range(400)]
        simulated = sum(trials) / len(trials)
        assert QWEN3_30B.expected_distinct(rows) == pytest.approx(simulated, rel=0.02), rows


@pytest.mark.parametrize(
    ("experts", "per_token", "message"),
    [
        (-1, 0, "num_experts must be >= 0"),
        (0, 2, "experts_per_token must be 0"),
        (8, 0, r"in \[1, num_experts=8\]"),
        (8, 9, r"in \[1, num_experts=8\], got 9"),
    ],
)
def test_routing_out_of_range_is_refused_by_name(experts: int, per_token: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExpertRouting(experts, per_token)
    with pytest.raises(ValueError, match="rows must be >= 0"):
        QWEN3_30B.expected_distinct(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_prices_distinct_experts_where_rows_alone_cannot(seed: int) -> None:
    """Fitted with the engine's routing, B=1 and B=16 decode steps are predicted within the fit's own
    worst error (measured <= 4% at 3% noise); a rows-only fit of the same steps misses them by
    >= 10% (measured 20% and 10-11%: a line through a saturating curve) and its own fit error is
    past 50%, as the rows-only model it replaced would be on an MoE engine."""
    samples = timed_steps(0.03, seed)
    moe, rows_only = StepCostModel.fit(samples, QWEN3_30B), StepCostModel.fit(samples)
    assert moe.routing == QWEN3_30B and moe.per_expert_ms == pytest.approx(0.6, rel=0.1)
    for batch in (1, 16):
        shape = StepShape(0, batch, batch * 256, 0)
        truth = TRUTH.predict_ms(shape)
        assert abs(moe.predict_ms(shape) - truth) / truth <= max(moe.max_relative_error, 0.01), batch
        assert abs(rows_only.predict_ms(shape) - truth) / truth >= 0.09, batch
    assert moe.max_relative_error < 0.05 < 0.5 < rows_only.max_relative_error


def test_a_dense_fit_is_what_it_was() -> None:
    """A dense model's record has exactly the fields engines wrote before experts (cached fits keep
    their checksums), an old record reads back dense, and an MoE record round-trips."""
    dense = StepCostModel(30.0, 1.8, 1.5, 0.002, 0.0001, 0.05)
    assert set(dense.to_json()) == DENSE_FIELDS
    assert StepCostModel.from_json(dense.to_json()) == dense
    old = {
        "base_ms": 5.3,
        "per_prefill_token_ms": 0.57,
        "per_decode_row_ms": 0.65,
        "per_decode_context_ms": 0.0026,
        "per_prefill_pair_ms": 0.00086,
        "max_relative_error": 0.1,
    }
    loaded = StepCostModel.from_json(old)
    assert loaded.routing == ExpertRouting() and loaded.per_expert_ms == 0.0
    assert loaded.predict_ms(StepShape(0, 16, 4096, 0)) == pytest.approx(5.3 + 16 * 0.65 + 4096 * 0.0026)
    assert StepCostModel.from_json(TRUTH.to_json()) == TRUTH
    assert TRUTH.to_json()["num_experts"] == 128 and TRUTH.to_json()["experts_per_token"] == 8


@pytest.mark.parametrize("start", [0, 300])
def test_the_largest_chunk_pays_for_the_experts_it_adds(start: int) -> None:
    """The chunk a budget gets beside 4 decode rows is the largest whose whole prediction (its rows'
    new experts included) fits the target: one more token would not. Pricing the experts of the
    decode rows only would give a chunk past the target."""
    decode = StepShape(0, 4, 4 * 200, 0)
    target = 40.0
    chunk = TRUTH.max_prefill_tokens(target, decode, start)

    def step(tokens: int) -> StepShape:
        return StepShape(tokens, 4, 4 * 200, StepShape.prefill_pairs(start, tokens))

    assert 0 < chunk and TRUTH.predict_ms(step(chunk)) <= target < TRUTH.predict_ms(step(chunk + 1))
    flat = StepCostModel(TRUTH.base_ms + TRUTH.per_expert_ms * QWEN3_30B.expected_distinct(4), 0.05, 0.05, 0.0005, 1e-6)
    assert flat.max_prefill_tokens(target, decode, start) > chunk + 10
    assert TRUTH.max_prefill_tokens(TRUTH.predict_ms(decode) - 0.1, decode, start) == 0


def test_calibration_times_the_batch_sizes_where_experts_still_grow() -> None:
    """Powers of two below the batch until ~90% of the experts are expected; none for dense."""
    assert expert_rows(QWEN3_30B, 32) == [2, 4, 8, 16]
    assert expert_rows(ExpertRouting(8, 2), 8) == [2, 4]
    assert expert_rows(ExpertRouting(), 32) == []
