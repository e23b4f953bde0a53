"""ifb bench: workloads are deterministic under a seed; percentiles and goodput on hand timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ifb.cli.bench_metrics import RequestTiming, Slo, percentile, summarize
from ifb.cli.bench_workloads import (
    LengthDistribution,
    dataset_workload,
    poisson_workload,
    seeds_workload,
)


def test_workloads_are_deterministic_under_a_seed() -> None:
    dist = LengthDistribution.parse("lognormal:50,0.7")
    a = poisson_workload(3.0, 20, dist, LengthDistribution.parse("uniform:5-40"), seed=7)
    b = poisson_workload(3.0, 20, dist, LengthDistribution.parse("uniform:5-40"), seed=7)
    c = poisson_workload(3.0, 20, dist, LengthDistribution.parse("uniform:5-40"), seed=8)
    assert a == b and a != c
    assert all(x.arrival_s < y.arrival_s for x, y in zip(a, a[1:], strict=False))
    assert all(5 <= r.max_tokens <= 40 for r in a)
    seeds = seeds_workload(seed=1)
    assert [r.max_tokens for r in seeds] == [20, 25, 30, 40, 50, 60, 400, 600] * 2
    assert seeds == seeds_workload(seed=1)


def test_bad_distribution_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fixed:N"):
        LengthDistribution.parse("gaussian:3")


def test_dataset_lines_need_prompt_and_max_tokens(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text(
        json.dumps({"prompt": "hi", "max_tokens": 4}) + "\n\n" + json.dumps({"prompt": "yo", "max_tokens": 2}) + "\n"
    )
    assert [(r.prompt, r.max_tokens, r.arrival_s) for r in dataset_workload(good)] == [("hi", 4, 0.0), ("yo", 2, 0.0)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        dataset_workload(bad)


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(7.6)
    assert percentile(values, 99) == pytest.approx(9.76)
    assert percentile([5.0], 95) == 5.0


def test_summary_and_goodput_on_hand_made_timings() -> None:
    fast = RequestTiming(arrival=0.0, token_times=[0.2, 0.3, 0.4], admitted=0.1, finished=0.4, num_tokens=3)
    slow_first = RequestTiming(arrival=0.0, token_times=[2.0, 2.1], admitted=1.5, finished=2.1, num_tokens=2)
    slow_itl = RequestTiming(arrival=1.0, token_times=[1.1, 1.6, 2.1], admitted=1.0, finished=2.1, num_tokens=3)
    failed = RequestTiming(arrival=0.0, ok=False)
    summary = summarize([fast, slow_first, slow_itl, failed], wall_s=2.0, slo=Slo.parse("ttft=500ms,itl=0.2"))
    assert summary["failed"] == 1 and summary["requests_per_s"] == 1.5
    assert summary["output_tokens_per_s"] == 4.0
    assert summary["goodput_requests_per_s"] == 0.5  # only `fast` meets both
    assert summary["ttft_p50_s"] == pytest.approx(0.2)
    assert summary["queue_p50_s"] == pytest.approx(0.1)
    assert summary["e2e_p99_s"] == pytest.approx(1.1 + (2.1 - 1.1) * 0.98)  # e2e: 0.4, 1.1, 2.1
    with pytest.raises(ValueError, match="unknown"):
        Slo.parse("tpot=1")
