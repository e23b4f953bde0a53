"""`ifb bench`: load generation, latency percentiles, mode comparison, plots and traces."""

from __future__ import annotations

import json
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from ifb.cli.bench_metrics import PERCENTILES, Slo, summarize
from ifb.cli.bench_runner import MODE_OPTIONS, ModeRun, run_against_url, run_in_process
from ifb.cli.bench_workloads import BenchRequest, LengthDistribution, dataset_workload, poisson_workload, seeds_workload
from ifb.cli.field_options import field_options, from_params
from ifb.runtime.runtime_config import option


@dataclass(frozen=True, slots=True)
class BenchOptions:
    """`ifb bench`'s options, each field one flag (cli/field_options.py)."""

    url: str | None = option(None, "Benchmark a running OpenAI-compatible server on loopback instead.")
    scenario: str = option("seeds", choices=("seeds", "poisson"))
    rate: float = option(2.0, "Poisson arrivals per second.")
    num_requests: int = option(32)
    prompt_len: str = option("lognormal:150,0.6", "fixed:N | uniform:A-B | lognormal:MEDIAN,SIGMA (words)")
    output_len: str = option("lognormal:60,0.8")
    dataset: Path | None = option(None, "JSONL with prompt, max_tokens.", exists=True)
    seed: int = option(0)
    compare: str = option("guaranteed_no_evict", f"Comma list of {','.join(MODE_OPTIONS)}.")
    max_batch_size: int | None = option(None)
    max_num_tokens: int | None = option(None)
    slo: str | None = option(None, "Goodput SLO, e.g. ttft=1.5,itl=0.1 (seconds).")
    time_limit: float = option(600.0, "Seconds per mode; the rest is aborted.")
    output: Path | None = option(None, "Write a JSON record.")
    plot: Path | None = option(None, "Folder for PNG plots.")
    trace: Path | None = option(None, "Chrome trace JSON (one file per mode).")

    def workload(self) -> list[BenchRequest]:
        if self.dataset is not None:
            return dataset_workload(
                self.dataset, rate=self.rate if self.scenario == "poisson" else None, seed=self.seed
            )
        if self.scenario == "seeds":
            return seeds_workload(self.seed)
        prompt_len, output_len = LengthDistribution.parse(self.prompt_len), LengthDistribution.parse(self.output_len)
        return poisson_workload(self.rate, self.num_requests, prompt_len, output_len, self.seed)


def _git_revision() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _table(rows: dict[str, dict[str, Any]]) -> str:
    columns = [
        ("req/s", "requests_per_s", 1),
        ("tok/s", "output_tokens_per_s", 1),
        ("goodput", "goodput_requests_per_s", 1),
    ]
    for name in ("ttft", "itl", "e2e"):
        columns += [(f"{name} p{q}", f"{name}_p{q}_s", 1000) for q in PERCENTILES]
    columns += [
        ("queue p50", "queue_p50_s", 1000),
        ("preempt", "preempted", 1),
        ("prefix hit", "prefix_hit_rate", 100),
        ("KV peak", "kv_peak_blocks", 1),
        ("busy seat-steps", "busy_seat_steps", 1),
        ("tok/step", "tokens_per_step", 1),
        ("accept %", "acceptance_rate", 100),
    ]
    head = f"{'mode':22s}" + "".join(f"{label:>11s}" for label, _, _ in columns)
    lines = [head, "(latencies in ms, prefix hit in %)"]
    for mode, row in rows.items():
        cells = []
        for _, key, scale in columns:
            value = row.get(key)
            cells.append(f"{'-':>11s}" if value is None else f"{value * scale:11.1f}")
        lines.append(f"{mode:22s}" + "".join(cells))
    return "\n".join(lines)


def _row(run: ModeRun, slo: Slo) -> dict[str, Any]:
    row: dict[str, Any] = summarize(run.timings, run.wall_s, slo)
    if run.stats:
        kv, counters = run.stats["kv"], run.stats["counters"]
        queried = kv["prefix_cache_queried_tokens"]
        row.update(
            preempted=counters["preempted"],
            prefix_hit_rate=kv["prefix_cache_hit_tokens"] / queried if queried else 0.0,
            kv_peak_blocks=max((s.num_used_blocks for s in run.steps), default=0),
            busy_seat_steps=sum(s.num_requests for s in run.steps),
            steps=len(run.steps),
            tokens_per_step=counters["generation_tokens"] / len(run.steps) if run.steps else None,
            acceptance_rate=counters["spec_num_accepted_tokens"] / counters["spec_num_draft_tokens"]
            if counters["spec_num_draft_tokens"]
            else None,
        )
    return row


@click.command()
@click.argument("target", required=False)
@field_options(BenchOptions)
def bench(target: str | None, **params: Any) -> None:
    """Measure TARGET (engine folder or SOURCE, in-process) or --url under a workload."""
    options = from_params(BenchOptions, params)
    try:
        workload = options.workload()
        goal = Slo.parse(options.slo)
        modes = [m.strip() for m in options.compare.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODE_OPTIONS]
        if unknown:
            raise ValueError(f"--compare: unknown modes {unknown}; choose from {list(MODE_OPTIONS)}")
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    if options.plot is not None and not options.url:
        from ifb.cli.bench_plots import import_pyplot

        import_pyplot()  # without matplotlib, fail now rather than after the whole benchmark
    runs: list[ModeRun] = []
    record: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "git_revision": _git_revision(),
        "workload": {
            "scenario": options.scenario,
            "dataset": str(options.dataset) if options.dataset else None,
            "rate": options.rate,
            "num_requests": len(workload),
            "seed": options.seed,
        },
    }
    with tqdm(
        total=len(workload) * (1 if options.url else len(modes)), desc="requests", file=click.get_text_stream("stderr")
    ) as bar:
        if options.url:
            try:
                runs.append(run_against_url(options.url, workload, options.time_limit, bar.update))
            except ValueError as error:
                raise click.ClickException(str(error)) from None
        else:
            from ifb.builder.build import BuildOptions
            from ifb.find_or_build import find_or_build_engine
            from ifb.runtime.engine_format import EngineConfig

            engine = find_or_build_engine(target, BuildOptions())
            config = EngineConfig.load(engine, verify=False)
            record["engine"] = {
                "folder": str(engine),
                "limits": config.limits.to_json(),
                "dtype": config.dtype,
                "kv_dtype": config.kv_dtype,
            }
            limits = {"max_batch_size": options.max_batch_size, "max_num_tokens": options.max_num_tokens}
            record["runtime"] = runtime = {k: v for k, v in limits.items() if v}
            for mode in modes:
                runs.append(
                    run_in_process(Path(engine), mode, workload, runtime, options.time_limit, bar.update, options.trace)
                )
    rows = {run.name: _row(run, goal) for run in runs}
    click.echo(_table(rows))
    record["results"] = rows
    if options.plot is not None and not options.url:
        from ifb.cli.bench_plots import write_plots

        for path in write_plots(runs, options.plot):
            click.echo(f"wrote {path}")
    if options.output is not None:
        options.output.parent.mkdir(parents=True, exist_ok=True)
        options.output.write_text(json.dumps(record, indent=2, default=str))
        click.echo(f"wrote {options.output}")
