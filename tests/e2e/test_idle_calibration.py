"""An engine this machine has no step cost model for serves at once and is timed in idle turns
(issue #39; runtime/step_budget/idle_calibration.py, serving_cost_model.py): the build leaves the
model `pending`, the first request is served under the conservative budget, calibration yields to
requests and completes afterwards, its fit is stored and the next load reuses it, and `calibrate=True`
(`ifb run --calibrate`) still measures before serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import TINY_LIMITS
from waiting import wait_until

import ifb.runtime.llm as llm_module
import ifb.runtime.step_budget.serving_cost_model as serving_module
from ifb import LLM, SamplingParams
from ifb.builder import calibrate as build_calibration
from ifb.builder.build import BuildOptions, build_engine
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.scheduler import ScheduledBatch
from ifb.runtime.step_budget.budgets import ConservativeBudget, CostModelSource, RelativeTargetBudget
from ifb.runtime.step_budget.cost_model_cache import CACHE_DIR_ENV, CostModelCache
from ifb.runtime.step_budget.idle_calibration import IdleCalibrator

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cost model cache of this module's own: the session's holds the build-time fit of the tiny
    engine's key, which would make the engine below `reused` instead of `pending`."""
    folder = tmp_path_factory.mktemp("cost-model-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_DIR_ENV, str(folder))
        yield folder


@pytest.fixture(scope="module")
def pending_engine(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, cache_dir: Path) -> Path:
    """The tiny Llama built with `calibration=serve` (what `ifb run SOURCE` builds) and no stored fit."""
    output = tmp_path_factory.mktemp("engines") / "tiny-llama-pending"
    options = BuildOptions(dtype="fp32", compute="fp32", calibration="serve", **TINY_LIMITS)
    summary = build_engine(tiny_llama_dir, output, options)
    assert summary.cost_model == "pending"
    return output


@pytest.fixture(autouse=True)
def each_test_starts_unmeasured(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No stored fit at the start of a test; a fit the tiny engine makes on a busy machine is noisy
    (NOISY_FIT), which is the build's rule too (tests/unit/test_cost_model_cache.py): here any fit is stored."""
    for entry in (cache_dir / "cost-models").glob("*.json"):
        entry.unlink()
    monkeypatch.setattr(serving_module, "NOISY_FIT", float("inf"))


class GatedCalibrator(IdleCalibrator):
    """The real calibrator, each of its steps let through by the test (`allow(n)`, `open()`); a
    held step returns at once as pending work, so the loop host goes on serving requests."""

    instances: list[GatedCalibrator] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.allowed: float = 0
        self.wake = threading.Event()
        self.log: list[str] | None = None  # shared with the test's step listener
        GatedCalibrator.instances.append(self)

    def allow(self, num_steps: float) -> None:
        self.allowed += num_steps
        self.wake.set()

    def step(self) -> bool:
        if self.allowed < 1:
            self.wake.wait(0.01)  # held: the host's next rotation sees any new request first
            self.wake.clear()
            return True
        self.allowed -= 1
        if self.log is not None:
            self.log.append("calibration")
        return super().step()


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[GatedCalibrator]]:
    GatedCalibrator.instances = []
    monkeypatch.setattr(llm_module, "IdleCalibrator", GatedCalibrator)
    yield GatedCalibrator
    for calibrator in GatedCalibrator.instances:
        calibrator.allow(float("inf"))  # never leave the host spinning on a held calibrator


def wait_for_idle_calibration(llm: LLM) -> None:
    """Until the executor dropped its idle work, which it does once the fit was stored, swapped into
    the budget and published (`on_fitted` returned), or once the work failed."""
    wait_until(lambda: llm.executor.idle_work is None, 60, "the idle calibration")
    assert llm.cost_model.source is CostModelSource.CALIBRATED_IDLE


def test_the_build_leaves_the_cost_model_pending(pending_engine: Path) -> None:
    config = EngineConfig.load(pending_engine)
    assert config.cost_model is None and config.build_info["cost_model"] == "pending"


def test_a_request_is_served_before_any_calibration_finished(
    pending_engine: Path, gated: type[GatedCalibrator]
) -> None:
    """Calibration held: the request gets its tokens under the conservative budget, with no point
    timed; let go, the calibration completes and its fit replaces the budget."""
    with LLM(pending_engine) as llm:
        (calibrator,) = gated.instances
        assert llm.cost_model.source is CostModelSource.PENDING
        assert isinstance(llm.executor.scheduler.step_budget, ConservativeBudget)
        assert len(llm.generate([PROMPT], GREEDY)[0].token_ids) == 8
        assert calibrator.progress.num_steps == 0 and llm.cost_model.source is CostModelSource.PENDING
        assert llm.health_report().body["step_budget"]["cost_model_source"] == "pending"
        calibrator.allow(float("inf"))
        wait_for_idle_calibration(llm)
        budget = llm.executor.scheduler.step_budget
        assert isinstance(budget, RelativeTargetBudget) and budget.cost_model == llm.cost_model.model
        assert calibrator.done and llm.executor.idle_work is None
        metrics = llm.metrics_text().decode()
        assert 'ifb:step_cost_model_info{source="calibrated_idle"} 1.0' in metrics
        llm.executor.scheduler.kv.check_integrity([])  # every lent block came back


def test_calibration_yields_to_a_request_and_completes_after_it(
    pending_engine: Path, gated: type[GatedCalibrator]
) -> None:
    """Three calibration steps run, then a request arrives; the calibration is let go from the
    request's first engine step on, yet no calibration step runs until the request's last step.
    The calibration then goes on where it stopped and completes."""
    with LLM(pending_engine) as llm:
        (calibrator,) = gated.instances
        events: list[str] = []
        calibrator.log = events
        calibrator.allow(3)
        wait_until(lambda: calibrator.progress.num_steps == 3, 60, "three calibration steps")

        def on_step(batch: ScheduledBatch) -> None:
            events.append("request")
            calibrator.allow(float("inf"))  # free to run from here on: only idleness holds it now

        llm.executor.step_started_listeners.append(on_step)
        output = llm.generate([PROMPT], GREEDY)[0]
        llm.executor.step_started_listeners.remove(on_step)
        assert len(output.token_ids) == 8
        wait_for_idle_calibration(llm)
    first, last = events.index("request"), len(events) - 1 - events[::-1].index("request")
    assert events[:first] == ["calibration"] * 3
    assert events[first : last + 1] == ["request"] * (last - first + 1), events
    assert events.count("request") == 8 and "calibration" in events[last:]
    assert calibrator.done


def test_the_fit_is_stored_and_the_next_load_reuses_it(pending_engine: Path) -> None:
    with LLM(pending_engine) as llm:
        wait_for_idle_calibration(llm)
        fitted = llm.cost_model.model
        assert CostModelCache().get(llm.cost_model.key) == fitted
    with LLM(pending_engine) as again:
        assert again.cost_model.source is CostModelSource.STORED and again.cost_model.model == fitted
        assert again.executor.idle_work is None
        budget = again.executor.scheduler.step_budget
        assert isinstance(budget, RelativeTargetBudget) and budget.cost_model == fitted
        assert again.health_report().body["step_budget"]["cost_model_source"] == "stored"


def test_calibrate_measures_before_serving_even_with_a_stored_fit(pending_engine: Path) -> None:
    """`ifb run --calibrate`: timed at start (before the LLM is returned), over a stored fit, which
    it replaces; no idle calibration follows."""
    with LLM(pending_engine) as first:
        wait_for_idle_calibration(first)
        stored = first.cost_model.model
    with LLM(pending_engine, calibrate=True) as llm:
        assert llm.cost_model.source is CostModelSource.CALIBRATED_AT_START
        fresh = llm.cost_model.model
        assert fresh is not None and fresh != stored and llm.executor.idle_work is None
        assert llm.executor.scheduler.step_budget.report().cost_model == fresh
        assert llm.generate([PROMPT], GREEDY)[0].token_ids
    assert CostModelCache().get(llm.cost_model.key) == fresh


def test_a_build_with_a_stored_fit_reuses_it_and_times_nothing(
    pending_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`calibration=serve` defers only a shape this machine never timed: with a stored fit the
    engine.json gets it (`reused`); without one nothing is timed in the build."""
    import shutil

    def no_timing(engine: object) -> None:
        raise AssertionError("the build timed the engine")

    monkeypatch.setattr(build_calibration, "calibrate", no_timing)
    folder = tmp_path / "engine"
    shutil.copytree(pending_engine, folder)
    assert build_calibration.calibrate_engine_folder(folder, dict, defer=True) is None
    assert EngineConfig.load(folder).build_info["cost_model"] == "pending"
    with LLM(pending_engine) as llm:
        wait_for_idle_calibration(llm)
        fitted = llm.cost_model.model
    assert build_calibration.calibrate_engine_folder(folder, dict, defer=True) == fitted
    config = EngineConfig.load(folder)
    assert config.cost_model == fitted and config.build_info["cost_model"] == "reused"


def test_a_no_cache_build_is_timed_when_serving_over_a_stored_fit(pending_engine: Path, tmp_path: Path) -> None:
    """`ifb build --no-cache --calibration serve`: the user asked for nothing stored to be reused, so
    the server times the engine (PENDING) though this machine holds a fit of its key; the plain
    pending engine of the same key takes that fit (STORED)."""
    import shutil

    with LLM(pending_engine) as llm:
        wait_for_idle_calibration(llm)
        stored = llm.cost_model.model
    folder = tmp_path / "engine"
    shutil.copytree(pending_engine, folder)
    assert build_calibration.calibrate_engine_folder(folder, dict, reuse=False, defer=True) is None
    no_cache = EngineConfig.load(folder)
    assert no_cache.cost_model is None and no_cache.build_info["cost_model"] == "pending"
    assert serving_module.ServingCostModel(no_cache, calibrate=False).source is CostModelSource.PENDING
    plain = serving_module.ServingCostModel(EngineConfig.load(pending_engine), calibrate=False)
    assert plain.source is CostModelSource.STORED and plain.model == stored
