"""`ifb run` refuses `--ttft-target-ms` with `--itl-target-ms 0` in one line naming both flags
(the step budget would ignore it: a fixed budget never grows a chunk for a deadline)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from ifb.cli.main import cli


def test_run_refuses_a_ttft_target_with_the_itl_target_off(tiny_llama_engine: Path) -> None:
    args = ["run", str(tiny_llama_engine), "--itl-target-ms", "0", "--ttft-target-ms", "500", "--prompt", "hi"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    error = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "--ttft-target-ms (ttft_target_ms) 500" in error[0], result.output
    assert "--itl-target-ms (itl_target_ms) 0" in error[0]
