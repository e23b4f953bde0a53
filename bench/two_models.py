"""Two busy models in one `ifb run` against one: how the loaded models share the cores.

    .venv/bin/python bench/two_models.py --engine ENGINE_DIR [--clients 8] [--window-s 30] [--threads 2]

One server process serves ENGINE_DIR twice, as models `a` and `b` (two LLMs, two step loops, the
same engine), with --threads THREADS. In one run: phase `alone`, CLIENTS streaming clients on `a`
before `b` has ever loaded (one step loop thread has run torch work: as a one-model server); then
`b` loads and, REPEATS times, phase `one`, CLIENTS on `a` (`b` loaded and idle), and phase `two`,
CLIENTS on `a` and CLIENTS on `b` at once. Each client
sends back-to-back completions (ignore_eos, MAX_TOKENS tokens) and a model's output tok/s is the
tokens of the requests that finished inside the window divided by the window. The clients run in
this process (asyncio, one thread): the server gets the cores they leave.

The machine may be shared: the server's CPU seconds over each window (from /proc) are printed too,
and tokens per CPU second is the figure a busy machine disturbs least (oversubscribed threads
spinning or waiting for each other cost CPU seconds per token).

Prints one JSON line per phase pair and the ratios; also the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx

MAX_TOKENS = 48
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, server: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and server.poll() is None:
        try:
            if httpx.get(url + "/health/live", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server at {url} did not start (exit code {server.poll()})")


async def client(http: httpx.AsyncClient, model: str, start: float, end: float, done: list[tuple[float, int]]) -> None:
    """Back-to-back streamed completions until `end`; (finish time, tokens) of each finished one."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    while time.perf_counter() < end:
        tokens = 0
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise SystemExit(f"{model}: {response.status_code} {await response.aread()!r}")
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens = usage["completion_tokens"]
        finished = time.perf_counter()
        if start <= finished <= end:
            done.append((finished, tokens))


def cpu_s(pid: int) -> float:
    """The process's user + system CPU seconds so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(
    url: str, pid: int, models: list[str], clients: int, warmup_s: float, window_s: float
) -> dict[str, float]:
    """Output tok/s per model with `clients` streaming clients on each of `models`, and the
    server's CPU seconds per wall second and tokens per CPU second over the window."""
    now = time.perf_counter()
    start, end = now + warmup_s, now + warmup_s + window_s
    done: dict[str, list[tuple[float, int]]] = {m: [] for m in models}
    cpu: list[float] = []

    async def sample_cpu() -> None:
        await asyncio.sleep(start - time.perf_counter())
        cpu.append(cpu_s(pid))
        await asyncio.sleep(end - time.perf_counter())
        cpu.append(cpu_s(pid))

    limits = httpx.Limits(max_connections=4 * clients * len(models))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        tasks = [client(http, m, start, end, done[m]) for m in models for _ in range(clients)]
        await asyncio.gather(sample_cpu(), *tasks)
    result = {m: round(sum(t for _, t in done[m]) / window_s, 1) for m in models}
    used = cpu[1] - cpu[0]
    tokens = sum(t for m in models for _, t in done[m])
    return result | {"cpu_per_s": round(used / window_s, 2), "tok_per_cpu_s": round(tokens / used, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=1, help="one/two phase pairs, alternating")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ifb.cli.main", "run", args.engine, args.engine]
    command += ["--served-model-name", "a", "--served-model-name", "b", "--threads", str(args.threads)]
    command += ["--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(command)
    try:
        wait_ready(url, server)
        body = {"model": "a", "prompt": "hi", "max_tokens": 2}  # a loads (b not yet)
        httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
        print(json.dumps({"load_avg_before": os.getloadavg(), "threads": args.threads, "clients": args.clients}))
        # Discarded: in two runs no request of the first phase after start finished inside its window.
        asyncio.run(phase(url, server.pid, ["a"], args.clients, args.warmup_s, args.window_s / 2))
        alone = asyncio.run(phase(url, server.pid, ["a"], args.clients, args.warmup_s, args.window_s))
        print(json.dumps({"alone": alone}))
        body = {"model": "b", "prompt": "hi", "max_tokens": 2}  # b loads, and its loop thread runs torch work
        httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
        for repeat in range(args.repeats):
            one = asyncio.run(phase(url, server.pid, ["a"], args.clients, args.warmup_s, args.window_s))
            two = asyncio.run(phase(url, server.pid, ["a", "b"], args.clients, args.warmup_s, args.window_s))
            total = two["a"] + two["b"]
            print(json.dumps({"repeat": repeat, "one": one, "two": two, "two_total": round(total, 1)}))
            print(
                f"one busy model: {one['a']:.1f} tok/s; two busy models: {two['a']:.1f} + {two['b']:.1f} = "
                f"{total:.1f} tok/s ({total / one['a']:.2f} x one); tokens per server CPU second "
                f"{one['tok_per_cpu_s']} -> {two['tok_per_cpu_s']} (CPU {one['cpu_per_s']} -> {two['cpu_per_s']} cores)"
            )
        print(json.dumps({"load_avg_after": os.getloadavg()}))
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
