"""Inter-token latency vs time to first token as the step latency target varies, same run.

    .venv/bin/python bench/itl_target.py [--engine ENGINE_DIR] [--targets 0,100,200,400]
                                        [--clients 8,32] [--requests-per-client 3] [--quick]

For each target (0 = off: the fixed max_num_tokens budget) it runs
  seeds     bench/batching.py's scenario in-process (two waves of eight ~200-token chat prompts,
            outputs 20 ... 600 tokens), and
  http-N    N streaming clients against `ifb run ENGINE --itl-target-ms T` (a separate process,
            as in production), each sending requests one after another: prompts of 100-600
            words, 32-128 output tokens, so long prompts keep arriving while others stream.
ITL is every gap between two streamed tokens of a request (pooled); TTFT from send to first
token. Prints one table and writes bench/out/itl_target.json and bench/out/itl_target.png (ITL
p99 against TTFT p99, one line per workload, one point per target). `--quick` shrinks the
workloads (for the tiny test engine: proves the script runs, measures nothing). An engine built
before calibration existed has no cost model: each run with a target then calibrates at start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from ifb.builder.build import BuildOptions
from ifb.cli.bench_metrics import RequestTiming, Slo, summarize
from ifb.cli.bench_runner import run_in_process
from ifb.cli.bench_workloads import BenchRequest, seeds_workload
from ifb.find_or_build import find_or_build_engine
from ifb.runtime.engine_format import EngineConfig

_WORDS = "time data model token batch cache block step query value key layer head graph engine queue seat".split()
METRICS = ("itl_p50_s", "itl_p99_s", "ttft_p50_s", "ttft_p99_s")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def client_requests(
    seed: int, count: int, prompt_words: tuple[int, int], outputs: tuple[int, int]
) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            0.0, " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*prompt_words))), rng.randint(*outputs)
        )
        for _ in range(count)
    ]


def label(target: float | None) -> str:
    return "default" if target is None else "off" if target == 0 else f"{target:g}"


@contextmanager
def server(engine: Path, target: float | None, max_batch_size: int, calibrate: bool) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "ifb.cli.main", "run", str(engine), "--port", str(port)]
    command += ["--max-batch-size", str(max_batch_size), "--log-level", "warning"]
    command += [] if target is None else ["--itl-target-ms", str(target)]
    command += ["--calibrate"] if calibrate else []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or process.poll() is not None:
                raise SystemExit(f"the server for target {target} did not start")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(30)


async def stream_one(client: httpx.AsyncClient, url: str, request: BenchRequest) -> RequestTiming:
    timing = RequestTiming(arrival=time.perf_counter())
    body = {
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            timing.ok = False
            return timing
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    timing.token_times.append(time.perf_counter())
    timing.finished = time.perf_counter()
    timing.num_tokens = len(timing.token_times)
    return timing


def run_clients(url: str, num_clients: int, per_client: int, quick: bool) -> tuple[list[RequestTiming], float]:
    """Closed loop: each client sends its next request when the previous one has finished."""
    words, outputs = ((10, 30), (8, 16)) if quick else ((100, 600), (32, 128))

    async def client_loop(client: httpx.AsyncClient, index: int) -> list[RequestTiming]:
        return [await stream_one(client, url, r) for r in client_requests(index, per_client, words, outputs)]

    async def main() -> tuple[list[RequestTiming], float]:
        limits = httpx.Limits(max_connections=num_clients + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            start = time.perf_counter()
            done = await asyncio.gather(*(client_loop(client, i) for i in range(num_clients)))
            return [t for timings in done for t in timings], time.perf_counter() - start

    return asyncio.run(main())


def summary_row(timings: list[RequestTiming], wall_s: float) -> dict[str, float]:
    row = summarize(timings, wall_s, Slo())
    return {key: row[key] for key in (*METRICS, "output_tokens_per_s", "failed")}


def run_target(engine: Path, target: float | None, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    rows = {}
    seeds = seeds_workload(wave_gap_s=args.wave_gap, prompt_words=40 if args.quick else 200)
    if args.quick:
        seeds = [BenchRequest(r.arrival_s, r.prompt, min(r.max_tokens, 24)) for r in seeds]
    config = EngineConfig.load(engine, verify=False)
    calibrate = (target is None or target > 0) and config.cost_model is None
    options = {"max_batch_size": 8, "itl_target_ms": target, "calibrate": calibrate}
    run = run_in_process(engine, "guaranteed_no_evict", seeds, options, 900, lambda n: None)
    rows["seeds"] = summary_row(run.timings, run.wall_s)
    seats = min(max(args.clients), config.limits.max_batch_size)
    for num_clients in args.clients:
        with server(engine, target, seats, calibrate) as url:
            timings, wall = run_clients(url, num_clients, args.requests_per_client, args.quick)
        rows[f"http-{num_clients}"] = summary_row(timings, wall)
    return rows


def print_table(results: dict[float | None, dict[str, dict[str, float]]]) -> None:
    print(
        f"{'workload':10s}{'target':>8s}"
        + "".join(f"{m.removesuffix('_s') + ' ms':>13s}" for m in METRICS)
        + f"{'tok/s':>8s}"
    )
    for workload in next(iter(results.values())):
        for target, rows in results.items():
            row = rows[workload]
            cells = "".join(f"{1000 * row[m]:13.0f}" for m in METRICS)
            name = label(target)
            print(f"{workload:10s}{name:>8s}{cells}{row['output_tokens_per_s']:8.1f}")


def plot(results: dict[float | None, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 5))
    for workload in next(iter(results.values())):
        points = [(rows[workload]["ttft_p99_s"], 1000 * rows[workload]["itl_p99_s"], t) for t, rows in results.items()]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=workload)
        for ttft, itl, target in points:
            axes.annotate(
                label(target) + ("" if target is None or target == 0 else " ms"),
                (ttft, itl),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
    axes.set_xlabel("TTFT p99 (s)")
    axes.set_ylabel("inter-token latency p99 (ms)")
    axes.set_title("Step latency target: stream smoothness vs first-token delay")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None)
    parser.add_argument(
        "--targets", default="0,default,100,200,400", help="ms; 0 = off; default = ifb's default (no flag)"
    )
    parser.add_argument("--clients", default="8,32")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--wave-gap", type=float, default=2.0)
    parser.add_argument("--quick", action="store_true", help="small workloads (tiny engines: a smoke run)")
    parser.add_argument("--output", type=Path, default=Path("bench/out/itl_target.json"))
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    engine = Path(args.engine or find_or_build_engine(None, BuildOptions(max_batch_size=32, max_num_tokens=512)))
    targets = [None if t == "default" else float(t) for t in args.targets.split(",")]
    results = {target: run_target(engine, target, args) for target in targets}
    print_table(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({label(t): rows for t, rows in results.items()}, indent=2))
    plot(results, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
