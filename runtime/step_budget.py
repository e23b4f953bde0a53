"""Step budgets: how many prefill tokens a step may take beside the decodes it already holds.

`FixedBudget` gives prefill whatever the decodes leave of max_num_tokens (the engine's limit).
`LatencyTargetBudget` gives the largest chunk whose predicted step time stays within an
inter-token target, and at least one block so every prompt keeps moving (see
scheduler_design.md). `make_step_budget` is the one place that chooses between them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from ifb.runtime.errors import LimitExceededError
from ifb.runtime.request import Request
from ifb.runtime.step_cost_model import StepCostModel, StepShape

logger = logging.getLogger(__name__)

# The default target is this many times the predicted decode step of a full batch at
# DEFAULT_TARGET_CONTEXT tokens each: decodes keep at least half of every step, and prefill
# chunks fill the other half. Issue #17's SmolLM2 fp32 figures (decode steps 60-100 ms with 8-32
# streams, ~1 s with a 512-token chunk) give a ~200 ms target and ~50-token chunks beside 32 rows.
DEFAULT_TARGET_DECODE_MULTIPLE = 2.0
DEFAULT_TARGET_CONTEXT = 256  # a typical chat turn's context


class StepBudget(Protocol):
    @property
    def itl_target_ms(self) -> float | None: ...

    @property
    def cost_model(self) -> StepCostModel | None: ...

    def prefill_token_budget(self, token_budget: int, decode: StepShape, prefill_start: int) -> int:
        """Of `token_budget` tokens left after the decodes in `decode`, how many prefill may use;
        `prefill_start` is the deepest cached context any prefill chunk of this step starts at."""
        ...

    def predict_ms(self, shape: StepShape) -> float | None: ...


class FixedBudget:
    """Today's budget: max_num_tokens per step, whatever the step then costs."""

    def __init__(self, cost_model: StepCostModel | None = None) -> None:
        self._cost_model = cost_model

    @property
    def itl_target_ms(self) -> float | None:
        return None

    @property
    def cost_model(self) -> StepCostModel | None:
        return self._cost_model

    def prefill_token_budget(self, token_budget: int, decode: StepShape, prefill_start: int) -> int:
        return token_budget

    def predict_ms(self, shape: StepShape) -> float | None:
        return None if self._cost_model is None else self._cost_model.predict_ms(shape)


class LatencyTargetBudget:
    """The largest prefill chunk that keeps the predicted step within the target, >= min_chunk."""

    def __init__(self, cost_model: StepCostModel, itl_target_ms: float, min_chunk_tokens: int) -> None:
        self._cost_model = cost_model
        self._target_ms = itl_target_ms
        self.min_chunk_tokens = min_chunk_tokens

    @property
    def itl_target_ms(self) -> float | None:
        return self._target_ms

    @property
    def cost_model(self) -> StepCostModel | None:
        return self._cost_model

    def prefill_token_budget(self, token_budget: int, decode: StepShape, prefill_start: int) -> int:
        fits = self._cost_model.max_prefill_tokens(self._target_ms, decode, prefill_start)
        return min(token_budget, max(self.min_chunk_tokens, fits))

    def predict_ms(self, shape: StepShape) -> float | None:
        return self._cost_model.predict_ms(shape)


def step_shape(chosen: Mapping[str, int], requests: Mapping[str, Request]) -> StepShape:
    """The cost-relevant shape of a step scheduling `chosen` (request id -> new tokens), taken
    before its tokens are computed."""
    prefill = decode_rows = decode_context = pairs = 0
    for request_id, n in chosen.items():
        start = requests[request_id].num_computed_tokens
        if n == 1:  # a one-token prompt tail runs on the decode path too (step/step_inputs.py)
            decode_rows += 1
            decode_context += start + 1
        else:
            prefill += n
            pairs += StepShape.prefill_pairs(start, n)
    return StepShape(prefill, decode_rows, decode_context, pairs)


def deepest_start(prefilling: Sequence[Request]) -> int:
    """The most cached context any of these prompts' next chunk starts after."""
    return max((r.num_computed_tokens for r in prefilling), default=0)


def default_itl_target_ms(cost_model: StepCostModel, max_batch_size: int) -> float:
    full_batch = StepShape(
        num_decode_rows=max_batch_size, num_decode_context_tokens=max_batch_size * DEFAULT_TARGET_CONTEXT
    )
    return round(DEFAULT_TARGET_DECODE_MULTIPLE * cost_model.predict_ms(full_batch), 1)


def make_step_budget(
    itl_target_ms: float | None, cost_model: StepCostModel | None, max_batch_size: int, block_size: int
) -> StepBudget:
    """`itl_target_ms`: None = the default from the cost model (fixed if there is none), 0 = off
    (fixed), > 0 = that target, which needs a cost model."""
    if itl_target_ms == 0 or (itl_target_ms is None and cost_model is None):
        if cost_model is None:
            logger.info("no step cost model (engine built before calibration): no inter-token latency target")
        return FixedBudget(cost_model)
    if cost_model is None:
        raise LimitExceededError(
            f"itl_target_ms {itl_target_ms} needs the engine's step cost model, and this engine.json has none "
            "(built before calibration existed); calibrate at start (`ifb run --calibrate`, LLM(..., "
            "calibrate=True)) or rebuild the engine"
        )
    target = default_itl_target_ms(cost_model, max_batch_size) if itl_target_ms is None else itl_target_ms
    logger.info("inter-token latency target %.1f ms%s", target, " (the default)" if itl_target_ms is None else "")
    return LatencyTargetBudget(cost_model, target, block_size)
