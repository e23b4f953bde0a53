"""One Poisson workload through `ifb run` (one process), `ifb serve --replicas 1` and
`ifb serve --replicas 2` on Ray Serve, same machine, same total threads; plus the cost of the
routing decision itself.

    .venv/bin/python bench/replicas.py [--engine ENGINE_DIR] [--rate 4] [--num-requests 32]

Threads: `ifb run` and one replica get --threads THREADS (default: all cores); two replicas get
THREADS/2 each, so every configuration uses the same cores. On a 2-core machine two replicas
cannot be faster than one: each has one core instead of two, and Ray's processes (controller,
HTTP proxy, ingress) compete for the same cores. Scale-out pays when replicas get their own
cores or accelerators; this script measures what the Ray Serve layer costs per request.

Routing overhead: `ifb serve --replicas 1` vs `ifb run` TTFT/e2e medians (the ingress hop, the
router, one Ray streaming call per request and one per delta), and the router's own work per
request (prefix keys of the first 32 blocks, lookup, power of two choices, remember) timed in
process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ifb.builder.build import BuildOptions
from ifb.cli.bench_metrics import Slo, summarize
from ifb.cli.bench_runner import run_against_url
from ifb.cli.bench_workloads import LengthDistribution, poisson_workload
from ifb.find_or_build import find_or_build_engine
from ifb.ray_serve.affinity import PrefixAffinity, ReplicaLoad, rank_replicas

RUN = [sys.executable, "-m", "ifb.cli.main", "run"]
SERVE = [sys.executable, "-c", "from ifb.cli.serve_command import serve; serve()"]  # until `ifb serve` is registered


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], num_ready: int | None, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and server.poll() is None:
        try:
            response = httpx.get(url + "/health", timeout=2)
            if response.status_code == 200 and (num_ready is None or response.json()["num_ready"] >= num_ready):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} did not start")


def serve_and_run(command: list[str], num_ready: int | None, workload: list[Any], slo: Slo) -> dict[str, float]:
    port = free_port()
    launcher = RUN if command[0] == "run" else SERVE
    server = subprocess.Popen(
        [*launcher, *command[1:], "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, server, num_ready)
        run_against_url(url, workload[:4], 300, lambda n: None)  # warm up: first-call costs, not routing
        run = run_against_url(url, workload, 900, lambda n: None)
        return summarize(run.timings, run.wall_s, slo)
    finally:
        server.terminate()
        server.wait(60)


def routing_decision_us(block_size: int, prompt_len: int, num_replicas: int = 2, n: int = 2000) -> float:
    """Microseconds per routing decision, as PrefixAffinityRouter makes it."""
    rng = random.Random(0)
    affinity = PrefixAffinity(block_size)
    prompts = [[rng.randrange(32000) for _ in range(prompt_len)] for _ in range(64)]
    loads = [ReplicaLoad(f"r{i}", rng.randrange(8), 0, 80) for i in range(num_replicas)]
    start = time.perf_counter()
    for i in range(n):
        keys = affinity.keys(prompts[i % 64], None)
        preferred, _ = affinity.lookup(keys)
        chosen = rank_replicas(loads, preferred, rng)[0]
        affinity.remember(keys, chosen)
    return 1e6 * (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--prompt-len", default="uniform:50-150")
    parser.add_argument("--output-len", default="uniform:16-64")
    parser.add_argument("--slo", default="ttft=2,itl=0.15")
    parser.add_argument("--output", type=Path, default=Path("bench/out/replicas.json"))
    args = parser.parse_args()
    engine = str(args.engine or find_or_build_engine(None, BuildOptions(max_batch_size=32, max_num_tokens=512)))
    slo = Slo.parse(args.slo)
    workload = poisson_workload(
        args.rate,
        args.num_requests,
        LengthDistribution.parse(args.prompt_len),
        LengthDistribution.parse(args.output_len),
        seed=7,
    )
    half = max(1, args.threads // 2)
    configs = {
        f"ifb run (1 process, {args.threads} threads)": (["run", engine, "--threads", str(args.threads)], None),
        f"serve 1 replica x {args.threads} threads": (
            ["serve", engine, "--replicas", "1", "--threads-per-replica", str(args.threads)],
            1,
        ),
        f"serve 2 replicas x {half} thread(s)": (
            ["serve", engine, "--replicas", "2", "--threads-per-replica", str(half)],
            2,
        ),
    }
    rows = {name: serve_and_run(command, ready, workload, slo) for name, (command, ready) in configs.items()}
    print(f"{args.num_requests} requests, Poisson {args.rate}/s, engine {engine}")
    print(f"{'configuration':40s}{'tok/s':>8s}{'ttft p50':>10s}{'ttft p95':>10s}{'itl p50':>9s}{'e2e p50':>9s}")
    for name, r in rows.items():
        print(
            f"{name:40s}{r['output_tokens_per_s']:8.1f}{1000 * r['ttft_p50_s']:10.0f}{1000 * r['ttft_p95_s']:10.0f}"
            f"{1000 * r['itl_p50_s']:9.1f}{1000 * r['e2e_p50_s']:9.0f}"
        )
    names = list(rows)
    hop_ms = 1000 * (rows[names[1]]["ttft_p50_s"] - rows[names[0]]["ttft_p50_s"])
    decision_us = routing_decision_us(16, 512)
    print(f"Ray Serve hop (serve 1 replica - ifb run), TTFT p50: {hop_ms:+.1f} ms per request")
    print(f"routing decision (512-token prompt, 32 blocks hashed): {decision_us:.0f} us per request")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"rows": rows, "serve_hop_ttft_p50_ms": hop_ms, "routing_decision_us": decision_us}, indent=2)
    )


if __name__ == "__main__":
    main()
