"""First-token deadlines: the prefill rate a queue of prompts needs, the chunk that gives it, and a
simulated burst (a fake engine whose steps take the cost model's time on the scheduler's clock)
in which the deadlines get more prompts their first token in time without breaking the ceiling."""

from __future__ import annotations

import pytest
from fakes import FakeEngine, make_request

from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind, make_capacity_policy, make_chunking_policy
from ifb.runtime.request import Request
from ifb.runtime.scheduler import Scheduler, SchedulerConfig
from ifb.runtime.step_budget.budgets import LatencyTargetBudget, StepBudget, make_step_budget
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape
from ifb.runtime.step_budget.first_token import (
    DEFAULT_CEILING_OVER_ITL_TARGET,
    FirstTokenDeadlines,
    PendingPrompt,
    default_ttft_target_ms,
)

BLOCK = 16
# Shaped like SmolLM2 int8 on 2 AVX-512 cores (an engine.json's fit): ms per step.
MODEL = StepCostModel(5.3, 0.57, 0.65, 0.0026, 0.00086)
DECODE = StepShape(num_decode_rows=24, num_decode_context_tokens=24 * 300)


# -- the rate ---------------------------------------------------------------------------------
def test_the_rate_saves_every_prompt_that_can_be_saved() -> None:
    deadlines = FirstTokenDeadlines(target_ms=1000.0)
    # 300 tokens with 500 ms left, then 300 more with 900 ms left: 0.6 and 0.667 tokens/ms.
    pending = [PendingPrompt(500.0, 300), PendingPrompt(100.0, 300)]
    assert deadlines.required_rate(pending, max_rate=10.0) == pytest.approx(600 / 900)
    # At most 0.62 tokens/ms the second is beyond saving: the first alone sets the rate.
    assert deadlines.required_rate(pending, max_rate=0.62) == pytest.approx(0.6)
    # A late prompt drives nothing but still sits ahead of the others.
    assert deadlines.required_rate([PendingPrompt(1200.0, 300), PendingPrompt(0.0, 100)], 10.0) == pytest.approx(0.4)
    # So does a preempted request recomputing (it had its first token): backlog, no deadline.
    assert deadlines.required_rate([PendingPrompt(None, 500), PendingPrompt(0.0, 100)], 10.0) == pytest.approx(0.6)
    assert deadlines.required_rate([], 10.0) == 0.0


def _step_ms(chunk: int, start: int = 0) -> float:
    return MODEL.predict_ms(
        StepShape(
            chunk, DECODE.num_decode_rows, DECODE.num_decode_context_tokens, StepShape.prefill_pairs(start, chunk)
        )
    )


def test_the_chunk_is_the_smallest_that_reaches_the_rate_within_the_ceiling() -> None:
    deadlines = FirstTokenDeadlines(target_ms=4000.0, ceiling_over_itl_target=1.5)
    target = 100.0
    itl_chunk = MODEL.max_prefill_tokens(target, DECODE, 0)
    relaxed = [PendingPrompt(0.0, 256)]  # 256 tokens in 4 s: the inter-token chunk is plenty
    assert deadlines.chunk(MODEL, 1.0, DECODE, 0, relaxed, itl_chunk, target) == itl_chunk
    urgent = [PendingPrompt(3000.0, 256) for _ in range(4)]  # 1024 tokens in 1 s
    chunk = deadlines.chunk(MODEL, 1.0, DECODE, 0, urgent, itl_chunk, target)
    needed = 1024 / 1000.0
    assert itl_chunk < chunk
    assert chunk / _step_ms(chunk) >= needed > (chunk - 1) / _step_ms(chunk - 1)
    assert _step_ms(chunk) <= 1.5 * target
    # Beyond saving at the ceiling's rate: back to the inter-token chunk, not a larger one.
    hopeless = [PendingPrompt(3900.0, 2000)]
    assert deadlines.chunk(MODEL, 1.0, DECODE, 0, hopeless, itl_chunk, target) == itl_chunk
    # A learned correction (steps run over their prediction) shrinks the ceiling's chunk with it.
    for correction in (1.05, 1.1, 1.2):
        corrected_itl_chunk = MODEL.max_prefill_tokens(target / correction, DECODE, 0)
        for prompts in range(1, 8):
            pending = [PendingPrompt(3000.0, 256)] * prompts
            corrected = deadlines.chunk(MODEL, correction, DECODE, 0, pending, corrected_itl_chunk, target)
            assert correction * _step_ms(corrected) <= 1.5 * target + 1e-6


def test_the_default_target_is_a_full_batch_prefilled_alone() -> None:
    chunk = MODEL.predict_ms(StepShape(512, 0, 0, 2 * StepShape.prefill_pairs(0, 256)))
    assert default_ttft_target_ms(MODEL, 32, 512) == pytest.approx(16 * chunk, abs=1)
    assert default_ttft_target_ms(StepCostModel(0.1, 0.001, 0.0, 0.0, 0.0), 1, 512) == 1000.0  # the floor


def test_the_factory_turns_the_deadlines_on_and_off() -> None:
    assert make_step_budget(None, MODEL, 32, BLOCK, ttft_target_ms=0).report().ttft_target_ms is None
    assert make_step_budget(None, MODEL, 32, BLOCK, 2500.0).report().ttft_target_ms == 2500.0
    derived = make_step_budget(None, MODEL, 32, BLOCK, None, max_num_tokens=512).report()
    assert derived.ttft_target_ms == default_ttft_target_ms(MODEL, 32, 512)
    assert make_step_budget(150.0, MODEL, 32, BLOCK, 3000.0).report().to_json()["ttft_target_ms"] == 3000.0


# -- a simulated burst ------------------------------------------------------------------------
class SimulatedClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def burst(budget: StepBudget) -> tuple[list[float], list[float]]:
    """16 streams decode while 16 more 256-token prompts arrive at once; each step takes its cost
    model's time on the scheduler's clock. Returns the burst's TTFTs and every step's time (ms)."""
    clock = SimulatedClock()
    kv = KVCacheManager(4096, BLOCK, False)
    scheduler = Scheduler(
        SchedulerConfig(32, 512, 2048),
        kv,
        make_capacity_policy(CapacityPolicyKind.GUARANTEED_NO_EVICT, kv),
        make_chunking_policy(ChunkingPolicyKind.FIRST_COME_FIRST_SERVED),
        budget,
        clock=clock,
    )
    engine = FakeEngine(scheduler, MODEL)
    streams = [make_request(64, 400, arrival=0.0) for _ in range(16)]
    for request in streams:
        scheduler.add(request)
    while any(r.num_output_tokens == 0 for r in streams):
        engine.step()
        clock.now += engine.step_ms[-1] / 1000
    arrived = clock.now
    prompts: list[Request] = [make_request(256, 8, arrival=arrived) for _ in range(16)]
    for request in prompts:
        scheduler.add(request)
    first_step = len(engine.step_ms)
    while any(r.times.first_token is None for r in prompts):
        engine.step()
        clock.now += engine.step_ms[-1] / 1000
    ttfts = [1000 * (r.times.first_token - arrived) for r in prompts if r.times.first_token is not None]
    return ttfts, engine.step_ms[first_step:]


def test_deadlines_get_more_first_tokens_in_time_within_the_ceiling() -> None:
    """A 60 ms inter-token target leaves a 16-stream batch ~35-token chunks; with a 4 s TTFT
    target the deadlines grow chunks (to at most the ceiling, 1.2 x 60 ms) while prompts can
    still make it."""
    itl_ms, ttft_ms = 60.0, 4000.0
    without_ttfts, without_steps = burst(LatencyTargetBudget(MODEL, itl_ms, BLOCK))
    with_ttfts, with_steps = burst(LatencyTargetBudget(MODEL, itl_ms, BLOCK, FirstTokenDeadlines(ttft_ms)))
    in_time_without = sum(t <= ttft_ms for t in without_ttfts)
    in_time_with = sum(t <= ttft_ms for t in with_ttfts)
    assert in_time_with > in_time_without, (sorted(with_ttfts), sorted(without_ttfts))
    assert max(with_ttfts) < max(without_ttfts)
    ceiling_ms = DEFAULT_CEILING_OVER_ITL_TARGET * itl_ms
    assert max(without_steps) <= itl_ms + 1e-6 < max(with_steps) <= ceiling_ms + 1e-6
    # Once no prompt is left to save, steps are back within the inter-token target.
    off = make_step_budget(itl_ms, MODEL, 32, BLOCK, ttft_target_ms=1.0)  # every prompt is late at once
    assert max(burst(off)[1]) <= itl_ms + 1e-6
