"""ifb bench in-process on a tiny engine: table, JSON record, plots and a Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from ifb.cli.main import cli


def test_compare_static_and_in_flight_with_plots_and_trace(tiny_llama_engine: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "load.jsonl"
    lengths = [4, 6, 8, 10, 60, 80, 5, 7, 9, 70, 3, 50]
    dataset.write_text(
        "\n".join(json.dumps({"prompt": f"hello world number {i}", "max_tokens": n}) for i, n in enumerate(lengths))
    )
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            str(tiny_llama_engine),
            "--dataset",
            str(dataset),
            "--compare",
            "static_batch,guaranteed_no_evict",
            "--max-batch-size",
            "4",
            "--slo",
            "ttft=5,itl=1",
            "--output",
            str(tmp_path / "record.json"),
            "--plot",
            str(tmp_path / "plots"),
            "--trace",
            str(tmp_path / "trace.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "record.json").read_text())
    static, inflight = record["results"]["static_batch"], record["results"]["guaranteed_no_evict"]
    assert record["engine"]["limits"]["max_batch_size"] == 8 and record["git_revision"]
    assert static["failed"] == inflight["failed"] == 0
    # static batching leaves seats idle while its slowest member finishes: more steps, lower utilization
    assert static["steps"] > inflight["steps"]
    assert static["busy_seat_steps"] / (4 * static["steps"]) < inflight["busy_seat_steps"] / (4 * inflight["steps"])
    for name in ("slot_timeline.png", "latency_cdf.png", "steps_over_time.png"):
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 5000 and path.read_bytes()[:4] == b"\x89PNG"
    for mode, row in record["results"].items():
        trace = json.loads((tmp_path / f"trace-{mode}.json").read_text())
        steps = [e for e in trace["traceEvents"] if e.get("name") == "step" and e["ph"] == "X"]
        requests = [e for e in trace["traceEvents"] if e.get("pid") == 1 and e["ph"] == "X"]
        assert len(steps) == row["steps"] and len(requests) == len(lengths)
        assert all(e["dur"] >= 0 for e in steps + requests)
