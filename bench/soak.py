"""Soak: minutes of mixed traffic against `ifb run` on loopback, watching for slow leaks.

    .venv/bin/python bench/soak.py --engine ENGINE_DIR [--minutes 10] [--clients 5]

Mixed traffic from a bounded pool of clients: plain and streaming completions, chat, n > 1,
guided (JSON schema and choice), tool calls (tool_choice auto and required, streamed or not),
seeded sampling, and aborts (streams dropped after a few chunks). A warm-up of the same traffic
comes first; then, with the server idle, the start sample: the server's RSS, its open file
descriptors and threads, the processes in its tree (grammar-compile workers included) and the
KV blocks in use. The soak runs for --minutes (RSS sampled every 30 s), the server goes idle
again, and the end sample is taken. PASS needs RSS growth <= 5% of the start sample, no KV
block in use when idle, no more fds, threads or processes at the end than at the start, and
none of the server's processes left 3 s after it is stopped (SIGTERM).
Bounded: it stops by itself after --minutes, and only talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 8}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
KINDS = ["plain", "stream", "chat", "n3", "json", "choice", "tools_auto", "tools_required", "seeded", "abort"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "weather", "in", "Paris", "time"]
WINDOW_S = 30.0
MAX_RSS_GROWTH = 0.05


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request_body(kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(path, body) of one request of `kind`."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    body: dict[str, Any] = {"max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7, 1.0])}
    if kind in ("chat", "tools_auto", "tools_required"):
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    if kind.startswith("tools"):
        body |= {"tools": TOOLS, "tool_choice": kind.removeprefix("tools_"), "max_tokens": 64}
        body["stream"] = rng.random() < 0.5
    if kind == "n3":
        body["n"] = 3
    elif kind == "json":
        body["guided_json"] = SCHEMA
    elif kind == "choice":
        body["guided_choice"] = ["yes", "no", "maybe"]
    elif kind == "seeded":
        body["seed"] = rng.randint(0, 1000)
    elif kind in ("stream", "abort"):
        body["stream"] = True
    return path, body


def one_request(client: httpx.Client, base: str, kind: str, rng: random.Random) -> str:
    """Send one request of `kind`; return its outcome: the first choice's finish reason,
    "aborted" for a stream dropped on purpose, or "http_<status>"."""
    path, body = request_body(kind, rng)
    if not body.get("stream"):
        response = client.post(base + path, json=body)
        if response.status_code != 200:
            return f"http_{response.status_code}"
        return str(response.json()["choices"][0]["finish_reason"])
    finish_reason = "no_finish_reason"
    with client.stream("POST", base + path, json=body) as response:
        if response.status_code != 200:
            return f"http_{response.status_code}"
        for i, line in enumerate(response.iter_lines()):
            if kind == "abort" and i >= 3:
                return "aborted"  # leaving the block closes the connection: the server must abort
            if line.startswith("data: {"):
                finish_reason = json.loads(line[6:])["choices"][0].get("finish_reason") or finish_reason
    return finish_reason


def drive(
    base: str, clients: int, seconds: float, seed: int
) -> tuple[Counter[tuple[str, str]], list[tuple[float, float]]]:
    """Run `clients` closed-loop clients for `seconds`; ((kind, outcome) counts, [(finish time, latency)])."""
    deadline = time.monotonic() + seconds
    outcomes: Counter[tuple[str, str]] = Counter()
    finished: list[tuple[float, float]] = []
    lock = threading.Lock()

    def client_loop(client_seed: int) -> None:
        rng = random.Random(client_seed)
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < deadline:
                kind, start = rng.choice(KINDS), time.monotonic()
                try:
                    outcome = one_request(client, base, kind, rng)
                except httpx.HTTPError as error:
                    outcome = f"transport_{type(error).__name__}"
                with lock:
                    outcomes[kind, outcome] += 1
                    finished.append((time.monotonic(), time.monotonic() - start))

    threads = [threading.Thread(target=client_loop, args=(seed + i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 180)
    return outcomes, finished


def wait_idle(base: str, timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until nothing runs or waits, then a little longer (aborts are applied after a step);
    return /health."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(base + "/health", timeout=10).json()
        if health["scheduling"]["resident"] == 0 and health["scheduling"]["queued"] == 0:
            break
        time.sleep(0.5)
    time.sleep(3)
    return httpx.get(base + "/health", timeout=10).json()


def sample(process: psutil.Process, health: dict[str, Any]) -> dict[str, float]:
    """The idle server's footprint: its own RSS, fds and threads, its process tree, KV in use."""
    tree_rss = process.memory_info().rss
    children = process.children(recursive=True)
    for child in children:
        try:
            tree_rss += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return {
        "rss_mb": round(process.memory_info().rss / 2**20, 1),
        "tree_rss_mb": round(tree_rss / 2**20, 1),
        "open_fds": process.num_fds(),
        "threads": process.num_threads(),
        "processes": 1 + len(children),
        "kv_blocks_used": health["kv_cache"]["kv_blocks_used"],
        "running": health["scheduling"]["resident"],
        "waiting": health["scheduling"]["queued"],
    }


def verdict(start: dict[str, float], end: dict[str, float]) -> list[str]:
    """The thresholds the end sample misses (empty: PASS)."""
    failures = []
    for key in ("rss_mb", "tree_rss_mb"):
        if end[key] > start[key] * (1 + MAX_RSS_GROWTH):
            failures.append(f"{key} grew {end[key] / start[key] - 1:.1%} (> {MAX_RSS_GROWTH:.0%})")
    for key in ("open_fds", "threads", "processes"):
        if end[key] > start[key]:
            failures.append(f"{key} grew {start[key]} -> {end[key]}")
    for key in ("kv_blocks_used", "running", "waiting"):
        if end[key]:
            failures.append(f"{key} = {end[key]} when idle")
    if end["processes_left_after_stop"]:
        failures.append(f"{end['processes_left_after_stop']} processes outlived the server's SIGTERM")
    return failures


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2) if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("bench/out/soak.json"))
    args = parser.parse_args()
    port = free_port()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    server_log = args.output.with_suffix(".server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "ifb.cli.main", "run", args.engine, "--port", str(port), "--max-queued-requests", "64"],
        stdout=server_log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                httpx.get(base + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        process = psutil.Process(server.pid)
        drive(base, args.clients, args.warmup_seconds, seed=1000)
        start = sample(process, wait_idle(base))
        print("start", json.dumps(start), flush=True)
        rss: list[tuple[float, float]] = []
        started = time.monotonic()

        def sample_rss() -> None:
            while time.monotonic() < started + args.minutes * 60:
                rss.append((round(time.monotonic() - started), round(process.memory_info().rss / 2**20, 1)))
                time.sleep(WINDOW_S)

        threading.Thread(target=sample_rss, daemon=True).start()
        outcomes, finished = drive(base, args.clients, args.minutes * 60, seed=0)
        health = wait_idle(base)
        end = sample(process, health)
        children = process.children(recursive=True)
    finally:
        server.terminate()
        server.wait(30)
    time.sleep(3)  # compile workers notice their parent is gone within a second
    end["processes_left_after_stop"] = sum(child.is_running() for child in children)
    windows: dict[int, list[float]] = {}
    for when, latency in finished:
        windows.setdefault(int((when - started) // WINDOW_S), []).append(latency)
    by_kind: dict[str, dict[str, int]] = {}
    by_outcome: Counter[str] = Counter()
    for (kind, outcome), count in sorted(outcomes.items()):
        by_kind.setdefault(kind, {})[outcome] = count
        by_outcome[outcome] += count
    failures = verdict(start, end)
    report = {
        "command": " ".join(sys.argv),
        "minutes": args.minutes,
        "clients": args.clients,
        "requests": sum(outcomes.values()),
        "outcomes": dict(by_outcome.most_common()),
        "outcomes_by_kind": by_kind,
        "start": start,
        "end": end,
        "growth": {key: round(end[key] - start[key], 1) for key in start},
        "rss_mb_every_30s": rss,
        "p99_latency_s_first_last_window": [p99(windows[min(windows)]), p99(windows[max(windows)])],
        "scheduling": health["scheduling"],
        "failures": failures,
        "verdict": "FAIL" if failures else "PASS",
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if failures:
        print("FAIL: " + "; ".join(failures))
    else:
        print("PASS: RSS growth <= 5%, no KV block in use when idle, no fd/thread/process growth, none left after stop")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
