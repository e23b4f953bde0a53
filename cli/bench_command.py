"""`ifb bench`: load generation, latency percentiles, mode comparison, plots and traces."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from ifb.cli.bench_metrics import PERCENTILES, Slo, summarize
from ifb.cli.bench_runner import MODE_OPTIONS, ModeRun, run_against_url, run_in_process
from ifb.cli.bench_workloads import BenchRequest, LengthDistribution, dataset_workload, poisson_workload, seeds_workload


def make_workload(
    scenario: str, dataset: Path | None, rate: float, num_requests: int, prompt_len: str, output_len: str, seed: int
) -> list[BenchRequest]:
    if dataset is not None:
        return dataset_workload(dataset, rate=rate if scenario == "poisson" else None, seed=seed)
    if scenario == "seeds":
        return seeds_workload(seed)
    return poisson_workload(
        rate, num_requests, LengthDistribution.parse(prompt_len), LengthDistribution.parse(output_len), seed
    )


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
@click.option("--url", default=None, help="Benchmark a running OpenAI-compatible server on loopback instead.")
@click.option("--scenario", type=click.Choice(["seeds", "poisson"]), default="seeds", show_default=True)
@click.option("--rate", type=float, default=2.0, show_default=True, help="Poisson arrivals per second.")
@click.option("--num-requests", type=int, default=32, show_default=True)
@click.option(
    "--prompt-len",
    default="lognormal:150,0.6",
    show_default=True,
    help="fixed:N | uniform:A-B | lognormal:MEDIAN,SIGMA (words)",
)
@click.option("--output-len", default="lognormal:60,0.8", show_default=True)
@click.option(
    "--dataset", type=click.Path(path_type=Path, exists=True), default=None, help="JSONL with prompt, max_tokens."
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--compare", default="guaranteed_no_evict", show_default=True, help=f"Comma list of {','.join(MODE_OPTIONS)}."
)
@click.option("--max-batch-size", type=int, default=None)
@click.option("--max-num-tokens", type=int, default=None)
@click.option("--slo", default=None, help="Goodput SLO, e.g. ttft=1.5,itl=0.1 (seconds).")
@click.option(
    "--time-limit", type=float, default=600.0, show_default=True, help="Seconds per mode; the rest is aborted."
)
@click.option("--output", type=click.Path(path_type=Path), default=None, help="Write a JSON record.")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Folder for PNG plots.")
@click.option("--trace", type=click.Path(path_type=Path), default=None, help="Chrome trace JSON (one file per mode).")
def bench(
    target: str | None,
    url: str | None,
    scenario: str,
    rate: float,
    num_requests: int,
    prompt_len: str,
    output_len: str,
    dataset: Path | None,
    seed: int,
    compare: str,
    max_batch_size: int | None,
    max_num_tokens: int | None,
    slo: str | None,
    time_limit: float,
    output: Path | None,
    plot: Path | None,
    trace: Path | None,
) -> None:
    """Measure TARGET (engine folder or SOURCE, in-process) or --url under a workload."""
    try:
        workload = make_workload(scenario, dataset, rate, num_requests, prompt_len, output_len, seed)
        goal = Slo.parse(slo)
        modes = [m.strip() for m in compare.split(",") if m.strip()]
        unknown = [m for m in modes if m not in MODE_OPTIONS]
        if unknown:
            raise ValueError(f"--compare: unknown modes {unknown}; choose from {list(MODE_OPTIONS)}")
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    if plot is not None and not url:
        from ifb.cli.bench_plots import import_pyplot

        import_pyplot()  # without matplotlib, fail now rather than after the whole benchmark
    runs: list[ModeRun] = []
    record: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "git_revision": _git_revision(),
        "workload": {
            "scenario": scenario,
            "dataset": str(dataset) if dataset else None,
            "rate": rate,
            "num_requests": len(workload),
            "seed": seed,
        },
    }
    with tqdm(
        total=len(workload) * (1 if url else len(modes)), desc="requests", file=click.get_text_stream("stderr")
    ) as bar:
        if url:
            try:
                runs.append(run_against_url(url, workload, time_limit, bar.update))
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
            options = {
                k: v for k, v in {"max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens}.items() if v
            }
            record["runtime"] = options
            for mode in modes:
                runs.append(run_in_process(Path(engine), mode, workload, options, time_limit, bar.update, trace))
    rows = {run.name: _row(run, goal) for run in runs}
    click.echo(_table(rows))
    record["results"] = rows
    if plot is not None and not url:
        from ifb.cli.bench_plots import write_plots

        for path in write_plots(runs, plot):
            click.echo(f"wrote {path}")
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(record, indent=2, default=str))
        click.echo(f"wrote {output}")
