"""Soak: minutes of mixed traffic against `ifb run` on loopback, watching for slow leaks.

    .venv/bin/python bench/soak.py --engine ENGINE_DIR [--minutes 10] [--clients 8]

Mixed traffic from a bounded pool of clients: plain and streaming completions, chat, n > 1,
guided (JSON schema and choice), seeded sampling, and cancellations (streams dropped after a few
tokens). Every 30 s it samples the server process's RSS and the latency of the requests that
finished in that window. At the end (after the server is idle) it reports RSS growth, KV blocks
still in use (leaks), the error count by kind, and the p99 latency drift from the first window
to the last. Bounded: it stops by itself after --minutes, and only talks to 127.0.0.1.
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

import httpx
import psutil

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}}
WINDOW_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_request(client: httpx.Client, base: str, rng: random.Random) -> str:
    """Send one random request; return its outcome ("ok", "cancelled", "http_4xx", ...)."""
    kind = rng.choice(["plain", "stream", "chat", "n3", "json", "choice", "seeded", "cancel"])
    prompt = " ".join(
        rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "then"]) for _ in range(rng.randint(4, 60))
    )
    body: dict = {"prompt": prompt, "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7, 1.0])}
    path = "/v1/completions"
    if kind == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24}
    elif kind == "n3":
        body["n"] = 3
    elif kind == "json":
        body["guided_json"] = SCHEMA
    elif kind == "choice":
        body["guided_choice"] = ["yes", "no", "maybe"]
    elif kind == "seeded":
        body["seed"] = rng.randint(0, 1000)
    if kind in ("stream", "cancel"):
        body["stream"] = True
        with client.stream("POST", base + path, json=body) as response:
            if response.status_code != 200:
                return f"http_{response.status_code}"
            for i, _ in enumerate(response.iter_lines()):
                if kind == "cancel" and i >= 3:
                    return "cancelled"
        return "ok"
    response = client.post(base + path, json=body)
    return "ok" if response.status_code == 200 else f"http_{response.status_code}"


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--output", type=Path, default=Path("bench/out/soak.json"))
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "ifb.cli.main", "run", args.engine, "--port", str(port), "--max-queued-requests", "64"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
        deadline = time.monotonic() + args.minutes * 60
        outcomes: Counter[str] = Counter()
        finished: list[tuple[float, float]] = []  # (finish time, latency)
        lock = threading.Lock()

        def client_loop(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(timeout=120) as client:
                while time.monotonic() < deadline:
                    start = time.monotonic()
                    try:
                        outcome = one_request(client, base, rng)
                    except httpx.HTTPError as error:
                        outcome = f"transport_{type(error).__name__}"
                    with lock:
                        outcomes[outcome] += 1
                        finished.append((time.monotonic(), time.monotonic() - start))

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        rss = [(0.0, process.memory_info().rss)]
        while time.monotonic() < deadline:
            time.sleep(min(WINDOW_S, max(0.0, deadline - time.monotonic())))
            rss.append((time.monotonic() - started, process.memory_info().rss))
        for thread in threads:
            thread.join(180)
        time.sleep(2)
        health = httpx.get(base + "/health").json()
    finally:
        server.terminate()
        server.wait(30)
    windows: dict[int, list[float]] = {}
    for when, latency in finished:
        windows.setdefault(int((when - started) // WINDOW_S), []).append(latency)
    keys = sorted(windows)
    report = {
        "minutes": args.minutes,
        "clients": args.clients,
        "requests": sum(outcomes.values()),
        "outcomes": dict(outcomes),
        "rss_mb_first_last": [round(rss[1][1] / 2**20, 1), round(rss[-1][1] / 2**20, 1)] if len(rss) > 1 else None,
        "rss_growth_mb_after_warmup": round((rss[-1][1] - rss[1][1]) / 2**20, 1) if len(rss) > 1 else None,
        "kv_blocks_used_when_idle": health["kv_cache"]["kv_blocks_used"],
        "running_waiting_when_idle": [health["scheduling"]["resident"], health["scheduling"]["queued"]],
        "p99_latency_s_first_last_window": [round(p99(windows[keys[0]]), 2), round(p99(windows[keys[-1]]), 2)],
        "scheduling": health["scheduling"],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
