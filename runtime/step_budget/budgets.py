"""Step budgets: how many prefill tokens a step may take beside the decodes it already holds.

`FixedBudget` gives prefill whatever the decodes leave of max_num_tokens (the engine's limit).
`ConservativeBudget` serves an engine whose cost model is still being timed in idle turns
(idle_calibration.py) until the fit replaces it. `LatencyTargetBudget` gives the largest chunk whose predicted step time stays within an
inter-token target, and at least one block so every prompt keeps moving (see
docs/design.md §5.6, §6). `RelativeTargetBudget` (the default) does the same with a target of a few
times this step's own decode time, so the worst gap stays a fixed multiple of the typical one at
any load. `make_step_budget` is the one place that chooses between them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from ifb.runtime.errors import LimitExceededError
from ifb.runtime.request import Request
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape
from ifb.runtime.step_budget.first_token import FirstTokenDeadlines, PendingPrompt, default_ttft_target_ms
from ifb.runtime.step_budget.time_correction import StepTimeCorrection

logger = logging.getLogger(__name__)

# The default target is this many times the predicted decode-only time of the step being built.
# A fixed target cannot serve every load: measured on SmolLM2 (bench/README.md), the median gap
# is the decode step, 33 ms with 8 streams and 100-170 ms with 32, and ITL p99 <= 3x p50 needed
# ~100 ms at 8 streams but ~200 ms at 32 (100 ms there cost 13% throughput and 12x the TTFT).
# 2.5x leaves the prediction error (a few ms) room under 3x.
DEFAULT_TARGET_DECODE_MULTIPLE = 2.5
# ...but never below this: a target of 2.5x a small batch's decode step shrinks every prompt to
# one-block chunks, and with 32 clients that starved prefill (TTFT p50 2 -> 32 s, throughput
# -22%, bench/README.md). The floor must also stay under 3x the decode step of a modest batch:
# at 100 ms, 8 streams (34 ms steps) had chunked steps of 100-120 ms, p99 3.5x p50. 80 ms leaves
# the corrected prediction's ~10% scatter room under 3 x 34 ms and still reads as smooth streaming.
DEFAULT_TARGET_FLOOR_MS = 80.0
DEFAULT_TARGET_CONTEXT = 256  # a typical chat turn's context (for the absolute figure /health shows)
# Without a cost model a chunk beside decodes is capped at this share of max_num_tokens: a long
# prompt then stalls the streams by about a quarter of a full step instead of all of it, and the
# cap lasts only until the idle-time fit arrives (tens of seconds of idleness).
CONSERVATIVE_CHUNK_SHARE = 0.25


class CostModelSource(str, Enum):
    """Where the cost model the budget uses came from (/health, /metrics, the load's log line)."""

    ENGINE = "engine"  # engine.json's, measured or reused by the build
    STORED = "stored"  # this machine's fit for the engine's key (cost_model_cache.py), found at load
    PENDING = "pending"  # none yet: a conservative budget while idle turns time the engine
    CALIBRATED_IDLE = "calibrated_idle"  # timed in the server's idle turns (then stored)
    CALIBRATED_AT_START = "calibrated_at_start"  # `--calibrate`: timed before serving (then stored)


@dataclass(frozen=True, slots=True)
class StepBudgetReport:
    """What a budget is doing, for /health: the active inter-token target (an absolute one, or a
    multiple of each step's decode time; neither = off, the fixed max_num_tokens budget), the
    time-to-first-token target that may grow a step's prefill (None = off), the cost model steps
    are predicted with, and the learned measured/predicted ratio."""

    itl_target_ms: float | None = None
    itl_target_decode_multiple: float | None = None
    cost_model: StepCostModel | None = None
    measured_over_predicted: float | None = None
    ttft_target_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        ratio = self.measured_over_predicted
        return {
            "itl_target_ms": self.itl_target_ms,
            "itl_target_decode_multiple": self.itl_target_decode_multiple,
            "ttft_target_ms": self.ttft_target_ms,
            "cost_model": None if self.cost_model is None else self.cost_model.to_json(),
            "measured_over_predicted": None if ratio is None else round(ratio, 3),
        }


class StepBudget(Protocol):
    def prefill_token_budget(
        self, token_budget: int, decode: StepShape, prefill_start: int, pending: Sequence[PendingPrompt] = ()
    ) -> int:
        """Of `token_budget` tokens left after the decodes in `decode`, how many prefill may use;
        `prefill_start` is the deepest cached context any prefill chunk of this step starts at;
        `pending`: the prompts before their first token this step could serve, in order."""
        ...

    def predict_ms(self, shape: StepShape) -> float | None: ...

    def step_target_ms(self, shape: StepShape) -> float | None:
        """The most a step shaped like `shape` may be predicted to take (uncorrected, like
        predict_ms), for what is added after its prefill (speculative drafts); None = no bound."""
        ...

    def observe_step(self, predicted_ms: float, measured_ms: float, has_prefill: bool) -> None:
        """A finished step's predicted and measured time (the whole loop iteration)."""
        ...

    def report(self) -> StepBudgetReport: ...


class FixedBudget:
    """Today's budget: max_num_tokens per step, whatever the step then costs."""

    def __init__(self, cost_model: StepCostModel | None = None) -> None:
        self.cost_model = cost_model

    def prefill_token_budget(
        self, token_budget: int, decode: StepShape, prefill_start: int, pending: Sequence[PendingPrompt] = ()
    ) -> int:
        return token_budget

    def predict_ms(self, shape: StepShape) -> float | None:
        return None if self.cost_model is None else self.cost_model.predict_ms(shape)

    def step_target_ms(self, shape: StepShape) -> float | None:
        return None  # no latency target: max_num_tokens is the only bound

    def observe_step(self, predicted_ms: float, measured_ms: float, has_prefill: bool) -> None:
        return None  # nothing to size

    def report(self) -> StepBudgetReport:
        return StepBudgetReport(cost_model=self.cost_model)


class ConservativeBudget:
    """While the cost model is timed in idle turns: a step without decodes takes all the prefill
    it can (it streams to nobody); beside decodes a chunk is at most CONSERVATIVE_CHUNK_SHARE of
    max_num_tokens, in whole blocks (at least one)."""

    def __init__(self, max_num_tokens: int, block_size: int) -> None:
        share = int(max_num_tokens * CONSERVATIVE_CHUNK_SHARE) // block_size * block_size
        self.max_chunk_tokens = max(block_size, share)

    def prefill_token_budget(
        self, token_budget: int, decode: StepShape, prefill_start: int, pending: Sequence[PendingPrompt] = ()
    ) -> int:
        return token_budget if decode.num_decode_rows == 0 else min(token_budget, self.max_chunk_tokens)

    def predict_ms(self, shape: StepShape) -> float | None:
        return None

    def step_target_ms(self, shape: StepShape) -> float | None:
        return None

    def observe_step(self, predicted_ms: float, measured_ms: float, has_prefill: bool) -> None:
        return None

    def report(self) -> StepBudgetReport:
        return StepBudgetReport()


class _CorrectedTarget:
    """What the two target budgets share: the cost model, its online correction, the first-token
    deadlines that may grow a chunk past the inter-token target (None = off), and sizing a chunk
    to the target each names for a step's decode rows (`_target_ms`)."""

    def __init__(
        self, cost_model: StepCostModel, min_chunk_tokens: int, deadlines: FirstTokenDeadlines | None = None
    ) -> None:
        self.cost_model = cost_model
        self.min_chunk_tokens = min_chunk_tokens
        self.correction = StepTimeCorrection()
        self.deadlines = deadlines

    @property
    def ttft_target_ms(self) -> float | None:
        return None if self.deadlines is None else self.deadlines.target_ms

    def predict_ms(self, shape: StepShape) -> float | None:
        return self.cost_model.predict_ms(shape)

    def observe_step(self, predicted_ms: float, measured_ms: float, has_prefill: bool) -> None:
        if has_prefill:
            self.correction.observe(predicted_ms, measured_ms)

    def _target_ms(self, decode: StepShape) -> float | None:
        """The uncorrected inter-token target of a step with these decode rows; None = no bound."""
        raise NotImplementedError

    def prefill_token_budget(
        self, token_budget: int, decode: StepShape, prefill_start: int, pending: Sequence[PendingPrompt] = ()
    ) -> int:
        """The largest chunk whose corrected prediction stays within the target, >= min_chunk,
        or the larger one the first-token deadlines of `pending` need (first_token.py)."""
        target_ms = self._target_ms(decode)
        if target_ms is None:
            return token_budget
        ratio = self.correction.ratio
        fits = max(self.min_chunk_tokens, self.cost_model.max_prefill_tokens(target_ms / ratio, decode, prefill_start))
        if self.deadlines is not None and pending and fits < token_budget:
            fits = self.deadlines.chunk(self.cost_model, ratio, decode, prefill_start, pending, fits, target_ms)
        return min(token_budget, fits)

    def step_target_ms(self, shape: StepShape) -> float | None:
        decode = StepShape(
            num_decode_rows=shape.num_decode_rows, num_decode_context_tokens=shape.num_decode_context_tokens
        )
        target_ms = self._target_ms(decode)
        return None if target_ms is None else target_ms / self.correction.ratio


class LatencyTargetBudget(_CorrectedTarget):
    """The largest prefill chunk that keeps the corrected predicted step within the target, >= min_chunk."""

    def __init__(
        self,
        cost_model: StepCostModel,
        itl_target_ms: float,
        min_chunk_tokens: int,
        deadlines: FirstTokenDeadlines | None = None,
    ) -> None:
        super().__init__(cost_model, min_chunk_tokens, deadlines)
        self._itl_target_ms = itl_target_ms

    def report(self) -> StepBudgetReport:
        return StepBudgetReport(self._itl_target_ms, None, self.cost_model, self.correction.ratio, self.ttft_target_ms)

    def _target_ms(self, decode: StepShape) -> float | None:
        return self._itl_target_ms


class RelativeTargetBudget(_CorrectedTarget):
    """The largest prefill chunk that keeps the corrected predicted step within `multiple` x this
    step's own predicted decode time, or `floor_ms` if that is more (>= min_chunk); a step with
    no decodes streams to nobody and takes it all."""

    def __init__(
        self,
        cost_model: StepCostModel,
        multiple: float,
        min_chunk_tokens: int,
        floor_ms: float = 0.0,
        deadlines: FirstTokenDeadlines | None = None,
    ) -> None:
        super().__init__(cost_model, min_chunk_tokens, deadlines)
        self._multiple = multiple
        self._floor_ms = floor_ms

    def report(self) -> StepBudgetReport:  # the target moves with the batch: a multiple, no ms
        return StepBudgetReport(None, self._multiple, self.cost_model, self.correction.ratio, self.ttft_target_ms)

    def _target_ms(self, decode: StepShape) -> float | None:
        if decode.num_decode_rows == 0:
            return None
        # The multiple applies to the uncorrected decode time: the correction is learned on chunked
        # steps, and scaling the target by it too would cancel it out. Where decode-only steps run
        # over their prediction as well, this errs toward smaller chunks (lower gaps).
        return max(self._floor_ms, self._multiple * self.cost_model.predict_ms(decode))


def step_shape(chosen: Iterable[tuple[Request, int]]) -> StepShape:
    """The cost-relevant shape of a step scheduling `chosen` ((request, new tokens) pairs), taken
    before its tokens are computed."""
    prefill = decode_rows = decode_context = pairs = 0
    for request, n in chosen:
        start = request.num_computed_tokens
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
    itl_target_ms: float | None,
    cost_model: StepCostModel | None,
    max_batch_size: int,
    block_size: int,
    ttft_target_ms: float | None = 0,
    max_num_tokens: int | None = None,
) -> StepBudget:
    """`itl_target_ms`: None = the default, a target of DEFAULT_TARGET_DECODE_MULTIPLE x each
    step's decode time (fixed if the engine has no cost model), 0 = off (fixed), > 0 = that
    absolute target, which needs a cost model. `ttft_target_ms` (with an inter-token target):
    None = derived from the cost model (first_token.py, for `max_num_tokens` per step), 0 = off,
    > 0 = that target; a fixed budget already gives prefill all it can."""
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
    deadlines = _first_token_deadlines(ttft_target_ms, cost_model, max_batch_size, max_num_tokens)
    if itl_target_ms is None:
        logger.info(
            "inter-token latency target: %.1fx each step's decode time, at least %.0f ms (%.1f ms for a full batch)",
            DEFAULT_TARGET_DECODE_MULTIPLE,
            DEFAULT_TARGET_FLOOR_MS,
            default_itl_target_ms(cost_model, max_batch_size),
        )
        return RelativeTargetBudget(
            cost_model, DEFAULT_TARGET_DECODE_MULTIPLE, block_size, DEFAULT_TARGET_FLOOR_MS, deadlines
        )
    logger.info("inter-token latency target %.1f ms", itl_target_ms)
    return LatencyTargetBudget(cost_model, itl_target_ms, block_size, deadlines)


def _first_token_deadlines(
    ttft_target_ms: float | None, cost_model: StepCostModel, max_batch_size: int, max_num_tokens: int | None
) -> FirstTokenDeadlines | None:
    if ttft_target_ms == 0:
        return None
    if ttft_target_ms is None:
        if max_num_tokens is None:
            raise ValueError("a default ttft target needs max_num_tokens")
        ttft_target_ms = default_ttft_target_ms(cost_model, max_batch_size, max_num_tokens)
        logger.info("time-to-first-token target %.0f ms (derived from the cost model)", ttft_target_ms)
    else:
        logger.info("time-to-first-token target %.0f ms", ttft_target_ms)
    return FirstTokenDeadlines(ttft_target_ms)
