"""Latency-targeted steps on the tiny compiled engine: the build's calibration, `calibrate=True`
at start, and greedy outputs that do not depend on the target."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ifb import LLM, SamplingParams
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.executor import StepRecord
from ifb.runtime.step_budget.budgets import FixedBudget, LatencyTargetBudget, RelativeTargetBudget
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape
from ifb.runtime.step_budget.first_token import default_ttft_target_ms
from ifb.runtime.trace import TraceRecorder

BLOCK = 16  # TINY_LIMITS


@pytest.fixture(scope="module")
def cost_model(tiny_llama_engine: Path) -> StepCostModel:
    model = EngineConfig.load(tiny_llama_engine).cost_model
    assert model is not None, "ifb build recorded no cost model"
    return model


def prompts(seed: int, n: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(20, 90))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def check_calibrated(model: StepCostModel) -> None:
    """A positive fixed cost, no negative term, and work costs time. (On the tiny model a prefill
    token, a decode row or a key costs microseconds, near the timing noise of a shared machine,
    so the fit may pin one of them at 0; SmolLM2's are all clearly positive.)"""
    assert model.base_ms > 0 and all(c >= 0 for c in model.coefficients)
    full = StepShape(48, 8, 8 * 200, StepShape.prefill_pairs(100, 48))
    assert model.predict_ms(full) > model.base_ms


def test_build_records_a_calibrated_cost_model(cost_model: StepCostModel) -> None:
    check_calibrated(cost_model)


def test_calibrate_at_start_measures_a_fresh_model(tiny_llama_engine: Path, cost_model: StepCostModel) -> None:
    with LLM(tiny_llama_engine, calibrate=True) as llm:
        fresh = llm.executor.scheduler.step_budget.report().cost_model
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert fresh is not None and fresh != cost_model
    check_calibrated(fresh)


def test_a_latency_target_serves_the_same_greedy_tokens(tiny_llama_engine: Path, cost_model: StepCostModel) -> None:
    """Twelve 20-90-token prompts at once: with the target off, steps take up to max_num_tokens
    (64); with a target below any step's cost, every step's prefill is one block (16) beside at
    most 8 decodes; with the default target in between. Greedy tokens are the same in all three;
    each step carries a prediction to the trace and the prediction-error histogram."""
    batch = prompts(seed=4)
    with LLM(tiny_llama_engine, itl_target_ms=0) as llm:
        assert isinstance(llm.executor.scheduler.step_budget, FixedBudget)
        off_steps: list[StepRecord] = []
        llm.executor.step_listeners.append(off_steps.append)
        off = [o.token_ids for o in llm.generate(batch, GREEDY)]
    assert max(s.num_tokens for s in off_steps) > BLOCK + 8

    for target, ttft in ((cost_model.base_ms / 2, None), (None, 2500.0)):
        with LLM(tiny_llama_engine, itl_target_ms=target, ttft_target_ms=ttft) as llm:
            budget = llm.executor.scheduler.step_budget
            assert isinstance(budget, LatencyTargetBudget if target else RelativeTargetBudget)
            steps: list[StepRecord] = []
            llm.executor.step_listeners.append(steps.append)
            trace = TraceRecorder.attach(llm.executor)
            outputs = [o.token_ids for o in llm.generate(batch, GREEDY)]
            health = llm.health_report().body
        assert outputs == off
        assert all(s.predicted_ms is not None and s.predicted_ms > 0 for s in steps)
        if target is not None:
            assert max(s.num_tokens for s in steps) <= BLOCK + 8
        assert health["step_budget"] == {
            "itl_target_ms": budget.report().itl_target_ms,
            "itl_target_decode_multiple": budget.report().itl_target_decode_multiple,
            "cost_model": cost_model.to_json(),
            "measured_over_predicted": round(budget.correction.ratio, 3),
            # the default is derived from the cost model (at least 1 s); LLM(ttft_target_ms=...) sets it
            "ttft_target_ms": 2500.0 if ttft else default_ttft_target_ms(cost_model, 8, 64),
            "cost_model_source": "engine",  # engine.json's (serving_cost_model.py)
        }
        # the chunked steps were observed: the ratio moved off its 1.0 prior, within its clamp
        assert budget.correction.num_observed > 0 and 0.5 <= budget.correction.ratio <= 2.0
        assert health["engine"] == {
            "backend": "cpu",
            "dtype": "float32",
            "kv_dtype": "float32",
            "weight_formats": [],
            "weight_compute": None,
            "kernels_isa": None,
        }
        count = llm.metrics.registry.get_sample_value("ifb:step_time_prediction_error_ratio_count")
        assert count == len(steps)
        counters = [e for e in trace.events if e["ph"] == "C" and e["name"] == "step_ms"]
        assert len(counters) == len(steps) and all(e["args"]["predicted"] > 0 for e in counters)
