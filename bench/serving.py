"""HTTP serving vs the in-process Python API on the same Poisson workload, same run.

    .venv/bin/python bench/serving.py [--engine ENGINE_DIR] [--rates 1,2,4] [--num-requests 24] [--repeats 3]

Starts `ifb run ENGINE` on a free loopback port (a separate process, as in production), drives
it with streaming /v1/completions requests, and runs the same workload through LLM in-process.
Each rate is repeated with a fresh seed, alternating which path goes first (one run of a few
dozen requests varies by +-8% on its own: the batch each request lands in depends on timing).
Reports TTFT / inter-token / end-to-end p50/p95/p99, throughput and goodput for the SLO, per
path over all repeats, and the throughput overhead from the pooled tokens / pooled wall time.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ifb.builder.build import BuildOptions
from ifb.cli.bench_metrics import Slo, summarize
from ifb.cli.bench_runner import ModeRun, run_against_url, run_in_process
from ifb.cli.bench_workloads import LengthDistribution, poisson_workload
from ifb.find_or_build import find_or_build_engine


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tokens_per_s(run: ModeRun) -> float:
    return sum(t.num_tokens for t in run.timings if t.ok) / run.wall_s


def pooled(runs: list[ModeRun], slo: Slo) -> dict[str, float]:
    """Every repeat's requests in one summary; throughput = all tokens / all wall time."""
    timings = [t for run in runs for t in run.timings]
    return summarize(timings, sum(run.wall_s for run in runs), slo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None)
    parser.add_argument("--rates", default="1,2,4")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slo", default="ttft=2,itl=0.15")
    parser.add_argument("--output", type=Path, default=Path("bench/out/serving.json"))
    args = parser.parse_args()
    engine = Path(args.engine or find_or_build_engine(None, BuildOptions(max_batch_size=32, max_num_tokens=512)))
    slo = Slo.parse(args.slo)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "ifb.cli.main", "run", str(engine), "--port", str(port), "--max-batch-size", "16"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        rows = {}
        for index, rate in enumerate(float(r) for r in args.rates.split(",")):
            runs: dict[str, list] = {"http": [], "python": []}
            for repeat in range(args.repeats):
                # a new seed per rate and repeat: the server keeps its prefix cache, a fresh
                # in-process LLM does not, so repeating prompts would flatter the HTTP path
                workload = poisson_workload(
                    rate,
                    args.num_requests,
                    LengthDistribution.parse("uniform:50-150"),
                    LengthDistribution.parse("uniform:16-96"),
                    seed=100 + 10 * index + repeat,
                )
                order = ("http", "python") if repeat % 2 == 0 else ("python", "http")
                for path in order:
                    if path == "http":
                        runs["http"].append(run_against_url(url, workload, 600, lambda n: None))
                    else:
                        runs["python"].append(
                            run_in_process(
                                engine, "guaranteed_no_evict", workload, {"max_batch_size": 16}, 600, lambda n: None
                            )
                        )
            rows[rate] = {path: pooled(found, slo) for path, found in runs.items()}
            rows[rate]["per_repeat_overhead"] = [  # type: ignore[assignment]
                1 - tokens_per_s(h) / tokens_per_s(p) for h, p in zip(runs["http"], runs["python"], strict=True)
            ]
    finally:
        server.terminate()
        server.wait(30)
    print(
        f"{'rate':>5s} {'path':7s}{'tok/s':>8s}{'goodput':>9s}"
        + "".join(f"{m + ' p' + q:>11s}" for m in ("ttft", "itl", "e2e") for q in ("50", "95", "99"))
    )
    for rate, pair in rows.items():
        for path in ("http", "python"):
            r = pair[path]
            cells = "".join(
                f"{1000 * r[f'{m}_p{q}_s']:11.0f}" for m in ("ttft", "itl", "e2e") for q in ("50", "95", "99")
            )
            print(f"{rate:5.1f} {path:7s}{r['output_tokens_per_s']:8.1f}{r['goodput_requests_per_s']:9.2f}{cells}")
        overhead = 1 - pair["http"]["output_tokens_per_s"] / pair["python"]["output_tokens_per_s"]
        spread = ", ".join(f"{100 * o:.1f}%" for o in pair["per_repeat_overhead"])
        print(f"      HTTP + streaming throughput overhead at {rate}/s: {100 * overhead:.1f}% (repeats: {spread})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({str(k): v for k, v in rows.items()}, indent=2))


if __name__ == "__main__":
    main()
