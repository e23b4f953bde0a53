"""The build's last stage: time the engine just written and record its step cost model.

The timing loop and the fit belong to the runtime (runtime/step_budget/calibration.py), so `ifb run
--calibrate` and the server's idle turns can redo them without the builder; this file only loads the
staged engine, runs them (or, deferred, leaves them to the server), and re-writes engine.json (which
is not among the hashed artifacts, so the hashes stay valid).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step.engine import Engine
from ifb.runtime.step_budget.calibration import NOISY_FIT, calibrate
from ifb.runtime.step_budget.cost_model import StepCostModel
from ifb.runtime.step_budget.cost_model_cache import CostModelCache, CostModelKey
from ifb.runtime.step_budget.expert_reads import ExpertRouting
from ifb.runtime.step_budget.serving_cost_model import REUSE_STORED_KEY

logger = logging.getLogger(__name__)


def calibrate_engine_folder(
    folder: Path,
    build_info: Callable[[], dict[str, Any]],
    reuse: bool = True,
    cache: CostModelCache | None = None,
    defer: bool = False,
) -> StepCostModel | None:
    """Record the cost model in `folder`'s engine.json, with `build_info()` as taken once it is
    measured (so the record holds the calibration's own time and peak memory); None (and a
    warning) if this machine cannot run the engine (a TensorRT engine built without a usable GPU).
    With `reuse`, a fit this machine stored for the same key (runtime/step_budget/cost_model_cache.py) is taken
    instead of timing; a new fit is stored either way unless it is noisy (NOISY_FIT: a busy machine).
    With `defer` and no stored fit, nothing is timed: engine.json says `pending` and the server times
    the engine in its idle turns (runtime/step_budget/idle_calibration.py), storing the fit here;
    without `reuse` (`--no-cache`) it also says the server must time it, not take a stored fit."""
    config = EngineConfig.load(folder, verify=False)  # hashed a moment ago by the writer
    cache = cache if cache is not None else CostModelCache()
    key = CostModelKey.of(config.to_json(), config.builder_version)
    stored = cache.get(key) if reuse else None
    routing = ExpertRouting(config.spec.num_experts, config.spec.num_experts_per_tok)
    if stored is not None and stored.routing != routing:
        # a mixture of experts timed before steps were priced by the experts they read: its fit
        # has no expert term, so it is timed again (and the new fit replaces it)
        logger.info("stored step cost model for key %s has no expert term: timing the engine again", key.digest[:12])
        stored = None
    if stored is not None:
        logger.info("step cost model reused: this machine timed an engine of the same key %s", key.digest[:12])
        info = {**build_info(), "cost_model": "reused"}
        dataclasses.replace(config, cost_model=stored, build_info=info).write(folder)
        return stored
    if defer:
        logger.info("no stored step cost model for key %s: the server times the engine when idle", key.digest[:12])
        info = {**build_info(), "cost_model": "pending", REUSE_STORED_KEY: reuse}
        dataclasses.replace(config, build_info=info).write(folder)
        return None
    try:
        engine = Engine(config)
    except EngineFormatError as error:
        logger.warning("engine built without a step cost model (cannot run it here: %s)", error)
        dataclasses.replace(config, build_info=build_info()).write(folder)
        return None
    try:
        model = calibrate(engine)
    finally:
        del engine  # the weights' mapping and the KV pool
    if model.max_relative_error <= NOISY_FIT:
        cache.put(key, model)
    else:  # timed on a busy machine: good enough for this engine, not to be handed to the next
        logger.info("step cost model not cached: its fit is off by up to %.0f%%", 100 * model.max_relative_error)
    dataclasses.replace(config, cost_model=model, build_info={**build_info(), "cost_model": "measured"}).write(folder)
    return model
