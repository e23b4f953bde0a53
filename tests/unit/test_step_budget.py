"""Step budgets: latency-targeted prefill chunks against a fake engine whose step time follows a
known cost model; the cost model's fit; the factory."""

from __future__ import annotations

import math
import random

import pytest
from fakes import FakeEngine, make_request, make_scheduler

from ifb.runtime.errors import LimitExceededError
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind
from ifb.runtime.request import Request
from ifb.runtime.scheduler import Scheduler
from ifb.runtime.step_budget.budgets import (
    DEFAULT_TARGET_DECODE_MULTIPLE,
    ConservativeBudget,
    FixedBudget,
    LatencyTargetBudget,
    RelativeTargetBudget,
    StepBudget,
    StepBudgetReport,
    default_itl_target_ms,
    make_step_budget,
)
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape

BLOCK = 16
# Shaped like SmolLM2 fp32 on 2 cores: 30 ms fixed, 1.8 ms a prefill token, 1.5 ms a decode row.
MODEL = StepCostModel(30.0, 1.8, 1.5, 0.002, 0.0001)
LINEAR = StepCostModel(30.0, 1.8, 1.5, 0.0, 0.0)  # no attention terms: the arithmetic is exact


def latency_scheduler(
    target_ms: float,
    model: StepCostModel = MODEL,
    *,
    policy: CapacityPolicyKind = CapacityPolicyKind.GUARANTEED_NO_EVICT,
    chunking: ChunkingPolicyKind = ChunkingPolicyKind.FIRST_COME_FIRST_SERVED,
    max_num_tokens: int = 512,
    num_blocks: int = 1024,
) -> Scheduler:
    budget: StepBudget = make_step_budget(target_ms, model, max_batch_size=16, block_size=BLOCK)
    return make_scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK,
        max_batch_size=16,
        max_num_tokens=max_num_tokens,
        max_seq_len=2048,
        policy=policy,
        chunking=chunking,
        budget=budget,
    )


def start_decoding(engine: FakeEngine, num_requests: int, max_tokens: int = 500) -> list[Request]:
    requests = [make_request(20, max_tokens) for _ in range(num_requests)]
    for request in requests:
        engine.scheduler.add(request)
    while any(r.num_output_tokens == 0 for r in requests):
        engine.step()
    return requests


def prefill_sizes(engine: FakeEngine, request: Request) -> list[int]:
    """The chunk `request` got in each step until its first token."""
    sizes = []
    while request.num_output_tokens == 0:
        batch = engine.step()
        sizes.append(next((i.num_new_tokens for i in batch.requests if i.request_id == request.request_id), 0))
    return sizes


# -- the cost model ---------------------------------------------------------------------------
def synthetic_points(model: StepCostModel, noise: float, seed: int) -> list[tuple[StepShape, float]]:
    rng = random.Random(seed)
    points = []
    for prefill in (0, 64, 256, 512):
        for rows in (0, 1, 8, 32):
            for context in (16, 1024):
                if prefill or rows:
                    shape = StepShape(prefill, rows, rows * context, StepShape.prefill_pairs(context, prefill))
                    points.append((shape, model.predict_ms(shape) * (1 + rng.uniform(-noise, noise))))
    return points


def test_fit_recovers_known_coefficients() -> None:
    """Exact points give the model back; its worst relative error is ~0."""
    fitted = StepCostModel.fit(synthetic_points(MODEL, 0.0, seed=0))
    for got, want in zip(fitted.coefficients, MODEL.coefficients, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    assert fitted.max_relative_error < 1e-6


def test_fit_with_noise_predicts_within_the_noise() -> None:
    points = synthetic_points(MODEL, 0.05, seed=1)
    fitted = StepCostModel.fit(points)
    assert fitted.max_relative_error < 0.1
    assert all(c >= 0 for c in fitted.coefficients)


def test_fit_never_returns_a_negative_cost() -> None:
    """A term the engine does not pay for (here decode context), fitted on noisy points, is pinned at
    0 rather than going negative, which would let a budget grow past its target."""
    truth = StepCostModel(30.0, 1.8, 1.5, 0.0, 0.0001)
    for seed in range(5):
        fitted = StepCostModel.fit(synthetic_points(truth, 0.1, seed))
        assert all(c >= 0 for c in fitted.coefficients), fitted


def test_cost_model_json_round_trips() -> None:
    model = StepCostModel.fit(synthetic_points(MODEL, 0.05, seed=2))
    assert StepCostModel.from_json(model.to_json()) == model


def test_max_prefill_tokens_is_the_largest_chunk_under_the_target() -> None:
    decode = StepShape(num_decode_rows=8, num_decode_context_tokens=8 * 300)
    for target, start in ((200.0, 0), (200.0, 1000), (500.0, 64), (47.0, 0)):
        chunk = MODEL.max_prefill_tokens(target, decode, start)

        def step(p: int, start: int = start) -> float:
            return MODEL.predict_ms(
                StepShape(
                    p, decode.num_decode_rows, decode.num_decode_context_tokens, StepShape.prefill_pairs(start, p)
                )
            )

        assert step(chunk) <= target < step(chunk + 1)
    assert MODEL.max_prefill_tokens(40.0, decode, 0) == 0  # the decodes alone take 46.8 ms


# -- the scheduler with a latency target -------------------------------------------------------
def test_chunks_shrink_while_decodes_run() -> None:
    """Target 205 ms: a prompt alone gets (205 - 30) / 1.8 = 97 tokens (96, block-aligned); beside
    8 decodes (12 ms of the step) only (205 - 42) / 1.8 = 90 (80)."""
    alone = FakeEngine(latency_scheduler(205.0, LINEAR), LINEAR)
    prompt = make_request(1000, 4)
    alone.scheduler.add(prompt)
    assert prefill_sizes(alone, prompt)[:3] == [96, 96, 96]

    crowded = FakeEngine(latency_scheduler(205.0, LINEAR), LINEAR)
    start_decoding(crowded, 8)
    prompt = make_request(1000, 4)
    crowded.scheduler.add(prompt)
    assert prefill_sizes(crowded, prompt)[:3] == [80, 80, 80]


def test_chunks_grow_back_when_the_decodes_finish() -> None:
    """Target 120 ms: 32 tokens beside 12 decodes ((120 - 48) / 1.8 = 40), 48 once they have
    finished ((120 - 30) / 1.8 = 50)."""
    engine = FakeEngine(latency_scheduler(120.0, LINEAR), LINEAR)
    decoding = start_decoding(engine, 12, max_tokens=6)
    prompt = make_request(1000, 4)
    engine.scheduler.add(prompt)
    sizes = prefill_sizes(engine, prompt)
    assert all(r.state.is_finished for r in decoding)
    assert sizes[0] == 32 and sizes[-2] == 48 and sum(sizes) == 1000


@pytest.mark.parametrize("chunking", list(ChunkingPolicyKind))
@pytest.mark.parametrize("policy", [CapacityPolicyKind.GUARANTEED_NO_EVICT, CapacityPolicyKind.MAX_UTILIZATION])
def test_every_step_stays_under_the_target(policy: CapacityPolicyKind, chunking: ChunkingPolicyKind) -> None:
    """Random arrivals, prompt lengths and (for max_utilization) preemptions in a small pool: each
    step either meets the target or carries no more prefill than the one-block minimum; the
    scheduler's prediction is the fake engine's step time."""
    target = 150.0
    engine = FakeEngine(
        latency_scheduler(target, policy=policy, chunking=chunking, num_blocks=80),
        MODEL,
    )
    rng = random.Random(7)
    for _ in range(300):
        if rng.random() < 0.3:
            prompt = [rng.randrange(3, 900) for _ in range(rng.choice([5, 40, 200, 700]))]
            engine.scheduler.add(make_request(0, rng.randint(1, 120), prompt=prompt))
        engine.step()
    engine.run_until_idle()
    for batch, shape, ms in zip(engine.batches, engine.shapes, engine.step_ms, strict=True):
        assert batch.predicted_ms == pytest.approx(ms)
        assert ms <= target or shape.num_prefill_tokens <= BLOCK, shape
    near_target = [ms for s, ms in zip(engine.shapes, engine.step_ms, strict=True) if s.num_prefill_tokens > BLOCK]
    assert sum(ms > 0.9 * target for ms in near_target) > 50  # chunks do fill steps up to the target
    assert engine.scheduler.stats.completed == engine.scheduler.stats.submitted
    if policy is CapacityPolicyKind.MAX_UTILIZATION:
        assert engine.scheduler.stats.preempted > 0


def test_prefix_hit_deeper_than_any_running_prompt_is_bounded_too() -> None:
    """A prompt admitted after a 640-token prefix hit reads 640+ keys per token: its chunk is
    sized for that depth (32 tokens), not for an empty context (144 tokens, ~1.2 s here)."""
    model = StepCostModel(30.0, 1.0, 1.5, 0.0, 0.01)  # attention-heavy: depth matters
    engine = FakeEngine(latency_scheduler(300.0, model), model)
    shared = list(range(200, 840))
    engine.scheduler.add(make_request(0, 1, prompt=shared + [7, 8]))
    engine.run_until_idle()
    second = make_request(0, 1, prompt=shared + [9] * 200)
    engine.scheduler.add(second)
    engine.step()
    assert second.num_computed_tokens == 640 + 32
    assert engine.step_ms[-1] <= 300.0


def test_ttft_grows_only_by_the_extra_steps_fixed_cost() -> None:
    """A 1,000-token prompt beside 8 decodes. With a linear model, splitting its prefill over k
    steps instead of m costs exactly (k - m) extra fixed parts (30 ms + 8 decode rows each):
    the prompt's own tokens cost the same however they are chunked."""
    results = {}
    for target in (0.0, 200.0):
        engine = FakeEngine(latency_scheduler(target, LINEAR), LINEAR)
        start_decoding(engine, 8)
        prompt = make_request(1000, 4)
        engine.scheduler.add(prompt)
        before = len(engine.step_ms)
        sizes = prefill_sizes(engine, prompt)
        results[target] = (len(sizes), engine.step_ms[before:])
    (m, off_ms), (k, target_ms) = results[0.0], results[200.0]
    assert m == 2  # 496 + 504 tokens (512 minus 8 decodes; the first ends on a block boundary)
    assert k == math.ceil(1000 / 80) == 13  # (200 - 42) / 1.8 = 87 -> 80 per step
    assert sum(target_ms) - sum(off_ms) == pytest.approx((k - m) * (30 + 8 * 1.5))
    assert max(target_ms) <= 200.0 < min(off_ms)


def test_minimum_chunk_keeps_a_prompt_moving_when_decodes_alone_exceed_the_target() -> None:
    """Target 20 ms < 12 decodes' own 48 ms: the prompt still advances one block per step."""
    engine = FakeEngine(latency_scheduler(20.0, LINEAR), LINEAR)
    start_decoding(engine, 12)
    prompt = make_request(100, 4)
    engine.scheduler.add(prompt)
    assert prefill_sizes(engine, prompt) == [16, 16, 16, 16, 16, 16, 4]


def chunk_trace(budget: StepBudget) -> list[dict[int, int]]:
    """Every step's {request index: tokens} on a seeded workload arriving one request per step."""
    engine = FakeEngine(
        make_scheduler(num_blocks=512, block_size=BLOCK, max_num_tokens=96, max_seq_len=512, budget=budget)
    )
    rng = random.Random(3)
    index: dict[str, int] = {}
    for n in range(40):
        prompt = [rng.randrange(3, 900) for _ in range(rng.randint(1, 300))]
        request = make_request(0, rng.randint(1, 30), prompt=prompt, arrival=float(n))
        index[request.request_id] = n
        engine.scheduler.add(request)
        engine.step()
    engine.run_until_idle()
    return [{index[i.request_id]: i.num_new_tokens for i in batch.requests} for batch in engine.batches]


def test_off_reproduces_the_fixed_budget_chunks_exactly() -> None:
    """itl_target_ms=0 is today's fixed token budget: step for step the same chunks as a latency
    budget no step reaches, and docs/design.md §6's worked example (budget 64, two 100-token
    prompts, FCFS) still holds."""
    off = make_step_budget(0, MODEL, max_batch_size=8, block_size=BLOCK)
    assert isinstance(off, FixedBudget)
    assert chunk_trace(off) == chunk_trace(LatencyTargetBudget(MODEL, 1e12, BLOCK))
    engine = FakeEngine(make_scheduler(block_size=BLOCK, max_num_tokens=64, num_blocks=64, budget=off))
    a, b = make_request(100, 4), make_request(100, 4)
    engine.scheduler.add(a)
    engine.scheduler.add(b)
    steps = [{i.request_id: i.num_new_tokens for i in engine.step().requests} for _ in range(3)]
    assert steps == [{a.request_id: 64}, {a.request_id: 36, b.request_id: 16}, {a.request_id: 1, b.request_id: 48}]


# -- the factory -------------------------------------------------------------------------------
def test_factory_chooses_by_target_and_model() -> None:
    assert isinstance(make_step_budget(None, None, 8, BLOCK), FixedBudget)
    default = make_step_budget(None, MODEL, 8, BLOCK)
    assert isinstance(default, RelativeTargetBudget)
    assert default.report().itl_target_ms is None
    assert default.report().itl_target_decode_multiple == DEFAULT_TARGET_DECODE_MULTIPLE
    assert default_itl_target_ms(MODEL, 8) == pytest.approx(2.5 * (30 + 8 * 1.5 + 0.002 * 8 * 256), abs=0.1)
    assert make_step_budget(250.0, MODEL, 8, BLOCK).report().itl_target_ms == 250.0
    off = make_step_budget(0, MODEL, 8, BLOCK)
    assert off.report() == StepBudgetReport(cost_model=MODEL)
    assert off.predict_ms(StepShape(num_decode_rows=1, num_decode_context_tokens=10)) == pytest.approx(31.52)
    with pytest.raises(LimitExceededError, match="itl_target_ms 100.0 needs .* --calibrate"):
        make_step_budget(100.0, None, 8, BLOCK)


def test_the_default_target_follows_the_batch() -> None:
    """2.5x this step's decode time: few decodes leave a small chunk, many a larger one, none
    (nobody streams) the whole budget; predicted steps stay within the multiple."""
    budget = RelativeTargetBudget(MODEL, 2.5, BLOCK)
    few = StepShape(num_decode_rows=2, num_decode_context_tokens=2 * 256)
    many = StepShape(num_decode_rows=32, num_decode_context_tokens=32 * 256)
    small, large = budget.prefill_token_budget(512, few, 0), budget.prefill_token_budget(512, many, 0)
    assert BLOCK <= small < large <= 512
    assert budget.prefill_token_budget(512, StepShape(), 0) == 512
    for decode, chunk in ((few, small), (many, large)):
        step = StepShape(
            chunk, decode.num_decode_rows, decode.num_decode_context_tokens, StepShape.prefill_pairs(0, chunk)
        )
        assert MODEL.predict_ms(step) <= 2.5 * MODEL.predict_ms(decode) + 1e-6 or chunk == BLOCK


def test_the_conservative_budget_caps_chunks_beside_decodes_only() -> None:
    """While idle turns time the cost model (step_budget/idle_calibration.py): a step with no
    decodes takes all the prefill it can; beside decodes a quarter of max_num_tokens in whole blocks,
    at least one block."""
    budget = ConservativeBudget(max_num_tokens=512, block_size=BLOCK)
    decoding = StepShape(num_decode_rows=4, num_decode_context_tokens=400)
    assert budget.prefill_token_budget(512, StepShape(), 0) == 512
    assert budget.prefill_token_budget(508, decoding, 0) == 128
    assert budget.prefill_token_budget(100, decoding, 0) == 100
    assert ConservativeBudget(max_num_tokens=40, block_size=BLOCK).prefill_token_budget(36, decoding, 0) == BLOCK
    assert budget.predict_ms(decoding) is None and budget.report().cost_model is None
