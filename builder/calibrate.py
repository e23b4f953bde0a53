"""The build's last stage: time the engine just written and record its step cost model.

The timing loop and the fit belong to the runtime (runtime/step/calibration.py), so `ifb run
--calibrate` can redo them without the builder; this file only loads the staged engine, runs
them, and re-writes engine.json (which is not among the hashed artifacts, so the hashes stay valid).
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
from ifb.runtime.step_budget.calibration import calibrate
from ifb.runtime.step_budget.cost_model import StepCostModel

logger = logging.getLogger(__name__)


def calibrate_engine_folder(folder: Path, build_info: Callable[[], dict[str, Any]]) -> StepCostModel | None:
    """Record the cost model in `folder`'s engine.json, with `build_info()` as taken once it is
    measured (so the record holds the calibration's own time and peak memory); None (and a
    warning) if this machine cannot run the engine (a TensorRT engine built without a usable GPU)."""
    config = EngineConfig.load(folder, verify=False)  # hashed a moment ago by the writer
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
    dataclasses.replace(config, cost_model=model, build_info=build_info()).write(folder)
    return model
