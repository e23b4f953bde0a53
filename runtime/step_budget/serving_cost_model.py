"""ServingCostModel: which step cost model a loaded engine starts with, and where a fit measured
while serving goes.

    engine.json has one          -> ENGINE     (the build measured it, or reused this machine's)
    else stored for its key      -> STORED     (cost_model_cache.py: an earlier run timed it),
                                                unless built `--no-cache` (REUSE_STORED_KEY false)
    else                         -> PENDING    a ConservativeBudget; idle turns time the engine
                                                (idle_calibration.py) -> CALIBRATED_IDLE
    `--calibrate` (any of these) -> timed before serving -> CALIBRATED_AT_START

A fit measured here is stored under the engine's key as a build's is (unless noisy: NOISY_FIT), so
the next load of this engine, or a build of the same shape, reuses it. /health shows the source
(`step_budget.cost_model_source`), /metrics as `ifb:step_cost_model_info{source=...}`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step_budget.budgets import CostModelSource
from ifb.runtime.step_budget.calibration import NOISY_FIT
from ifb.runtime.step_budget.cost_model import StepCostModel
from ifb.runtime.step_budget.cost_model_cache import CostModelCache, CostModelKey
from ifb.runtime.step_budget.expert_reads import ExpertRouting

logger = logging.getLogger(__name__)

# engine.json's build record says whether a pending engine may start from a stored fit: false for
# `ifb build --no-cache`, whose user asked for nothing of this machine's caches to be reused (a
# fit stored by an earlier build of the same shape was taken here before).
REUSE_STORED_KEY = "reuse_stored_cost_model"


class ServingCostModel:
    """The cost model an LLM's budget uses (None while PENDING or before `--calibrate` measured it)."""

    def __init__(self, engine: EngineConfig, calibrate: bool, cache: CostModelCache | None = None) -> None:
        self.cache = cache if cache is not None else CostModelCache()
        self.key = CostModelKey.of(engine.to_json(), engine.builder_version)
        self.model: StepCostModel | None = None
        if calibrate:
            self.source = CostModelSource.CALIBRATED_AT_START
            return
        routing = ExpertRouting(engine.spec.num_experts, engine.spec.num_experts_per_tok)
        may_reuse = engine.build_info.get(REUSE_STORED_KEY, True)
        stored = self.cache.get(self.key) if engine.cost_model is None and may_reuse else None
        if engine.cost_model is not None:
            self.model, self.source = engine.cost_model, CostModelSource.ENGINE
        elif stored is not None and stored.routing == routing:  # an MoE fit without its expert term: timed again
            self.model, self.source = stored, CostModelSource.STORED
        else:
            self.source = CostModelSource.PENDING
        logger.info("step cost model: %s (key %s)", self.source.value, self.key.digest[:12])

    def measured(self, model: StepCostModel, source: CostModelSource) -> None:
        """A fit timed on this engine now: stored for the next load, then published as this
        engine's (a reader that sees the new `source` finds the fit stored too)."""
        if model.max_relative_error <= NOISY_FIT:
            self.cache.put(self.key, model)
            logger.info("step cost model %s and stored under key %s", source.value, self.key.digest[:12])
        else:
            logger.info(
                "step cost model %s, not stored: its fit is off by up to %.0f%%",
                source.value,
                100 * model.max_relative_error,
            )
        self.model, self.source = model, source


class CostModelInfoCollector(Collector):
    """`ifb:step_cost_model_info{source=...} 1`: where the budget's cost model came from."""

    def __init__(self, serving: ServingCostModel) -> None:
        self.serving = serving

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily(
            "ifb:step_cost_model_info",
            "Where the step budget's cost model came from: engine, stored, pending (a conservative budget "
            "while idle turns time the engine), calibrated_idle or calibrated_at_start.",
            labels=["source"],
        )
        info.add_metric([self.serving.source.value], 1.0)
        yield info
