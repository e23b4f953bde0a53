"""Options that would do nothing are refused naming why, never silently ignored: a
time-to-first-token target without an inter-token target, `--dtype float16` on the CPU backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from engine_records import engine_config

from ifb.cli.main import cli
from ifb.runtime.errors import LimitExceededError
from ifb.runtime.runtime_config import RuntimeSettings, resolve_runtime_config
from ifb.runtime.step_budget.cost_model import StepCostModel

COST_MODEL = StepCostModel(5.3, 0.57, 0.65, 0.0026, 0.00086)
CALIBRATED = engine_config(cost_model=COST_MODEL)


def test_a_ttft_target_with_the_itl_target_off_is_refused_naming_both_flags() -> None:
    with pytest.raises(LimitExceededError) as caught:
        resolve_runtime_config(CALIBRATED, RuntimeSettings(itl_target_ms=0, ttft_target_ms=500))
    message = str(caught.value)
    assert "--ttft-target-ms (ttft_target_ms) 500" in message and "--itl-target-ms (itl_target_ms) 0" in message


def test_a_ttft_target_on_an_engine_without_a_cost_model_is_taken() -> None:
    """Without a cost model the server times one in its idle turns (step_budget/idle_calibration.py)
    and the default inter-token target applies from then on, so the ttft target is not refused."""
    uncalibrated = engine_config(cost_model=None)
    resolve_runtime_config(uncalibrated, RuntimeSettings(ttft_target_ms=500))
    resolve_runtime_config(uncalibrated, RuntimeSettings(ttft_target_ms=500, calibrate=True))  # measured at start


@pytest.mark.parametrize(
    ("itl", "ttft"),
    [(0, 0), (0, None), (None, 500), (150, 500), (150, None), (None, 0)],
    ids=["both-off", "itl-off-ttft-default", "itl-default", "both-set", "ttft-default", "ttft-off"],
)
def test_a_ttft_target_with_an_itl_target_is_kept(itl: float | None, ttft: float | None) -> None:
    config = resolve_runtime_config(CALIBRATED, RuntimeSettings(itl_target_ms=itl, ttft_target_ms=ttft))
    assert (config.itl_target_ms, config.ttft_target_ms) == (itl, ttft)


def test_build_refuses_float16_on_the_cpu_backend_in_one_line(tmp_path: Path) -> None:
    """The README lists float16 for the tensorrt backend only; the CPU backend says so before any work."""
    result = CliRunner().invoke(
        cli, ["build", "--dtype", "float16", "-o", str(tmp_path / "engine"), "--max-batch-size", "2"]
    )
    assert result.exit_code == 1
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert error == [
        "Error: dtype 'float16' is not supported by the cpu backend; choose one of auto, bfloat16 (bf16), "
        "float32 (fp32)"
    ]
    assert not (tmp_path / "engine").exists()


def test_run_refuses_the_pair_in_one_line_before_loading_anything(tmp_path: Path) -> None:
    """`ifb run` names both flags and exits 1: the folder holds nothing but engine.json, so the
    settings were refused against the engine's record before any engine file was read."""
    (tmp_path / "engine.json").write_text(json.dumps(CALIBRATED.to_json()))
    args = ["run", str(tmp_path), "--itl-target-ms", "0", "--ttft-target-ms", "500", "--prompt", "hi"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "--ttft-target-ms (ttft_target_ms) 500" in error[0], result.output
    assert "--itl-target-ms (itl_target_ms) 0" in error[0]
