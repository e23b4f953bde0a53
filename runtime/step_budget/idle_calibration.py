"""IdleCalibrator: the step cost model timed on the serving engine in the loop host's idle turns.

An engine this machine has no fit for (none in engine.json, none stored under its key) serves at
once with a conservative budget (budgets.ConservativeBudget) instead of timing ~a dozen shapes
before its first token (28 s for SmolLM2, 191 s for a 1B Q4_K_M on 2 quiet cores, issue #39).
The same points calibration.py times in a build are timed here, one engine step per idle turn:
the loop host gives a turn to idle work only when no loaded model stepped or had work waiting
(loop_host.py), so a request that arrives waits for at most one calibration step, and the
points go on where they stopped once the server is idle again.

    turn:  warm-up of point 0 | timed | timed | ... (>= MIN_REPEATS, POINT_BUDGET_S of steps) | point 1 ...
           each step borrows its KV blocks from the scheduler's pool (KVCacheManager.lend) and
           gives them back before the next schedule: no request's blocks are ever written

The last point's median completes the fit, which `on_fitted` receives on the host thread (the
runtime LLM stores it under the engine's key and swaps it into the live budget).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import build_step_inputs
from ifb.runtime.step_budget.calibration import (
    MAX_REPEATS,
    MIN_REPEATS,
    POINT_BUDGET_S,
    CalibrationPoint,
    calibration_points,
    fit_samples,
    point_slices,
)
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CalibrationProgress:
    """How far an idle calibration got: points fully timed of all, engine steps run."""

    num_points_done: int
    num_points: int
    num_steps: int


class IdleCalibrator:
    """Times calibration points one engine step per `step()` call, on KV blocks lent by `kv`."""

    def __init__(self, engine: Engine, kv: KVCacheManager, on_fitted: Callable[[StepCostModel], None]) -> None:
        self._engine = engine
        self._kv = kv
        self._on_fitted = on_fitted
        self._max_blocks = kv.num_blocks  # the scheduler's blocks, all free whenever the engine is idle
        self._points = calibration_points(engine, self._max_blocks)
        self._samples: list[tuple[StepShape, float]] = []
        self._times: list[float] = []  # the current point's timed steps, ms
        self._warmed = False
        self._num_steps = 0
        self._started: float | None = None

    @property
    def progress(self) -> CalibrationProgress:
        return CalibrationProgress(len(self._samples), len(self._points), self._num_steps)

    @property
    def done(self) -> bool:
        return len(self._samples) == len(self._points)

    def step(self) -> bool:
        """Run one engine step of the current point; True while points remain after it."""
        if self._started is None:
            self._started = time.perf_counter()
            logger.info("timing the step cost model in idle turns: %d shapes", len(self._points))
        point = self._points[len(self._samples)]
        elapsed_ms = self._timed_step(point)
        self._num_steps += 1
        if not self._warmed:  # as calibration.time_step_ms: one untimed run of the shape first
            self._warmed = True
            return True
        self._times.append(elapsed_ms)
        if len(self._times) < MAX_REPEATS and (
            len(self._times) < MIN_REPEATS or sum(self._times) < 1000 * POINT_BUDGET_S
        ):
            return True
        self._samples.append((point.shape, statistics.median(self._times)))
        self._times, self._warmed = [], False
        if not self.done:
            return True
        model = fit_samples(self._engine, self._samples, time.perf_counter() - self._started)
        self._on_fitted(model)
        return False

    def _timed_step(self, point: CalibrationPoint) -> float:
        """One step of `point` on blocks lent for it, in ms (the step alone, as calibration times it)."""
        slices = point_slices(self._engine, point, self._max_blocks)
        wanted = sorted({block for piece in slices for block in piece.block_table})
        lent = self._kv.lend(len(wanted))
        try:
            physical = dict(zip(wanted, lent, strict=True))
            placed = [replace(s, block_table=[physical[b] for b in s.block_table]) for s in slices]
            inputs = build_step_inputs(placed, self._engine.config.limits.block_size)
            begin = time.perf_counter()
            self._engine.step(inputs)
            return 1000 * (time.perf_counter() - begin)
        finally:
            self._kv.take_back(lent)
