"""Soak: minutes of mixed traffic against `ifb run` on loopback, watching for slow leaks and wrong replies.

    .venv/bin/python bench/soak.py --engine ENGINE_DIR [--minutes 10] [--clients 5] [--speculative suffix]

The server runs with guided decoding, tools (the template's hermes parser), a reasoning parser
(`--reasoning-parser qwen3` and a chat template whose `enable_thinking` opens `<think>`) and
speculative decoding (`--speculative suffix`, a small suffix cache so it evicts). Mixed traffic
from a bounded pool of clients: plain and streaming completions, chat, n > 1, guided (JSON schema
and choice), tool calls (tool_choice auto and required, streamed or not), seeded sampling, aborts
(streams dropped after a few chunks), reasoning (with and without a budget, and a think block a
guided reply spells out) and speculation's kinds (repetitive greedy and seeded prompts, repeated,
whose text must not change). Each reply is checked against what its kind must give
(bench/soak_kinds.py); every failed request is counted per kind and fails the run.

A warm-up of the same traffic comes first; then, with the server idle, the start sample: the
server's RSS, its open file descriptors and threads, the processes in its tree (grammar-compile
workers included) and the KV blocks in use. The soak runs for --minutes (RSS and the load average
sampled every 30 s), the server goes idle again, and the end sample is taken. PASS needs no failed
request (warm-up included), RSS growth outside the KV pool <= 5% of the start sample (the pool's
pages become resident as steps first write them, up to its size: reported, not judged), no KV
block in use when idle, no more fds, threads or processes at the end than at the start, none of
the server's processes left 3 s after it is stopped (SIGTERM), draft tokens accepted during the
soak and replies with reasoning_content. Bounded: it stops by itself after --minutes, and only talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from soak_kinds import KINDS, THINKING_TEMPLATE, Outcome, Repeats, send

WINDOW_S = 30.0
MAX_RSS_GROWTH = 0.05
MAX_EXAMPLES = 30
# A request with no reply (or, streamed, no chunk) for this long is hung: on a machine whose load
# slows steps 100-fold a 64-token request takes minutes, so the bound is far above any seen.
REQUEST_TIMEOUT_S = 600.0
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(slots=True)
class Tally:
    """What the clients saw: outcomes per kind, problems per kind, and the first problems in full."""

    outcomes: Counter[tuple[str, str]] = field(default_factory=Counter)
    problems: Counter[tuple[str, str]] = field(default_factory=Counter)
    reasoned: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    finished: list[tuple[float, float]] = field(default_factory=list)  # (finish time, latency)
    latencies: dict[str, list[float]] = field(default_factory=dict)

    def add(self, kind: str, outcome: Outcome, latency: float) -> None:
        self.outcomes[kind, outcome.finish] += 1
        self.reasoned[kind] += outcome.reasoned
        if outcome.problem is not None:
            self.problems[kind, outcome.problem.split(":")[0]] += 1
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"{kind}: {outcome.problem} | {outcome.detail}")
        self.finished.append((time.monotonic(), latency))
        self.latencies.setdefault(kind, []).append(latency)

    def by_kind(self) -> dict[str, dict[str, Any]]:
        report: dict[str, dict[str, Any]] = {}
        for kind in KINDS:
            finishes = {finish: n for (k, finish), n in sorted(self.outcomes.items()) if k == kind}
            problems = {problem: n for (k, problem), n in sorted(self.problems.items()) if k == kind}
            failed = sum(problems.values())
            report[kind] = {"ok": sum(finishes.values()) - failed, "failed": failed, "finish": finishes}
            if kind in self.latencies:  # a slow kind stands out here (a hung request would be at the timeout)
                ordered = sorted(self.latencies[kind])
                report[kind]["latency_s_median_max"] = [round(ordered[len(ordered) // 2], 1), round(ordered[-1], 1)]
            if problems:
                report[kind]["problems"] = problems
            if kind.startswith("reasoning"):
                report[kind]["with_reasoning_content"] = self.reasoned[kind]
        return report


def drive(base: str, clients: int, seconds: float, seed: int, repeats: Repeats, tally: Tally | None = None) -> Tally:
    """Run `clients` closed-loop clients for `seconds`, counting into `tally` (a new one if None)."""
    deadline = time.monotonic() + seconds
    tally = Tally() if tally is None else tally
    lock = threading.Lock()
    kinds = itertools.cycle(random.Random(seed).sample(KINDS, len(KINDS)))

    def client_loop(client_seed: int) -> None:
        rng = random.Random(client_seed)
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            while time.monotonic() < deadline:
                with lock:  # one round robin over all clients: any len(KINDS) requests cover every kind
                    kind = next(kinds)
                start = time.monotonic()
                try:
                    outcome = send(client, base, kind, rng, repeats)
                except Exception as error:  # a reply the checks could not even read is a wrong shape
                    outcome = Outcome("unreadable", f"unreadable reply: {type(error).__name__}: {error}")
                with lock:
                    tally.add(kind, outcome, time.monotonic() - start)

    threads = [threading.Thread(target=client_loop, args=(seed + i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + REQUEST_TIMEOUT_S + 60)
    return tally


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


def kv_pool_resident(pid: int, pool_bytes: int) -> tuple[int, int]:
    """(resident bytes, size) of the anonymous mapping that holds the KV pool. The pool's pages
    are backed when a step first writes them (runtime/step/kv_pool.py) and the free list hands
    out the least recently used block, so over a soak more and more of it is touched: RSS climbs
    towards the pool's size (engine.json `kv_pool.bytes`), bounded, not a leak. The kernel merges
    the pool's mapping with an adjacent anonymous one of the same permissions, so the mapping
    found (the largest anonymous one at least the pool's size) may be a little larger."""
    found = [m for m in psutil.Process(pid).memory_maps(grouped=False) if m.path == "[anon]" and m.size >= pool_bytes]
    if not found:
        return 0, 0
    pool = max(found, key=lambda m: m.size)
    return pool.rss, pool.size


def sample(process: psutil.Process, health: dict[str, Any], pool_bytes: int) -> dict[str, float]:
    """The idle server's footprint: its own RSS (and the part outside the KV pool), fds and
    threads, its process tree, KV in use."""
    tree_rss = process.memory_info().rss
    children = process.children(recursive=True)
    for child in children:
        try:
            tree_rss += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    kv, mapping_size = kv_pool_resident(process.pid, pool_bytes)
    return {
        "rss_mb": round(process.memory_info().rss / 2**20, 1),
        "kv_pool_resident_mb": round(kv / 2**20, 1),
        "kv_pool_mapping_extra_mb": round((mapping_size - pool_bytes) / 2**20, 1),  # merged beside it
        "rss_outside_kv_pool_mb": round((process.memory_info().rss - kv) / 2**20, 1),
        "tree_rss_outside_kv_pool_mb": round((tree_rss - kv) / 2**20, 1),
        "open_fds": process.num_fds(),
        "threads": process.num_threads(),
        "processes": 1 + len(children),
        "kv_blocks_used": health["kv_cache"]["kv_blocks_used"],
        "running": health["scheduling"]["resident"],
        "waiting": health["scheduling"]["queued"],
    }


def verdict(
    start: dict[str, float], end: dict[str, float], warmup: Tally, soak: Tally, spec: dict[str, Any]
) -> list[str]:
    """What the run misses (empty: PASS): a leak threshold, a failed request, speculation unused."""
    failures = []
    for key in ("rss_outside_kv_pool_mb", "tree_rss_outside_kv_pool_mb"):
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
    for phase, tally in (("warm-up", warmup), ("soak", soak)):
        for (kind, problem), count in sorted(tally.problems.items()):
            failures.append(f"{phase}: {count} x {kind}: {problem}")
    if not spec["num_accepted_tokens"]:
        failures.append(f"speculation never had a draft token accepted: {spec}")
    if not soak.reasoned["reasoning"] or not soak.reasoned["reasoning_guided"]:
        failures.append(f"no reply had reasoning_content: {dict(soak.reasoned)}")
    return failures


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    """`ifb run` with guided decoding's pool, tools (hermes), reasoning and speculation on."""
    template = args.output.with_suffix(".chat_template.jinja")
    template.write_text(THINKING_TEMPLATE)
    command = [
        *(sys.executable, "-m", "ifb.cli.main", "run", args.engine, "--port", str(port)),
        *("--max-queued-requests", "64", "--chat-template", str(template), "--reasoning-parser", "qwen3"),
        *("--speculative", args.speculative, "--suffix-cache-tokens", str(args.suffix_cache_tokens)),
    ]
    server_log = args.output.with_suffix(".server.log").open("w")
    return subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT)


def memory_by_mapping(pid: int) -> dict[str, float]:
    """The server's RSS by kind of mapping, to tell where growth is: the main malloc arena
    ([heap]: mostly the event loop's thread, Python objects), anonymous mappings (other threads'
    malloc arenas, torch's large buffers, the KV pool) and files (libraries, the mapped weights)."""
    totals = {"heap": 0.0, "anonymous": 0.0, "files": 0.0}
    for mapping in psutil.Process(pid).memory_maps(grouped=True):
        path = mapping.path
        kind = "heap" if path == "[heap]" else "files" if path.startswith("/") else "anonymous"
        totals[kind] += mapping.rss / 2**20
    return {kind: round(mb, 1) for kind, mb in totals.items()}


def cpu_name() -> str:
    """lscpu's model name and the vector ISA flags that pick the kernels."""
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx", "avx_vnni")))
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(isa)}"


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2) if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--speculative", choices=["ngram", "suffix"], default="suffix")
    parser.add_argument(
        "--suffix-cache-tokens", type=int, default=4096, help="small, so the suffix cache evicts during the soak"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/out/soak.json"))
    args = parser.parse_args()
    port = free_port()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(args, port)
    base, repeats = f"http://127.0.0.1:{port}", Repeats()
    pool_bytes = json.loads((Path(args.engine) / "engine.json").read_text())["kv_pool"]["bytes"]
    load = [os.getloadavg()]
    try:
        while True:
            if server.poll() is not None:
                sys.exit(f"the server exited ({server.returncode}): see {args.output.with_suffix('.server.log')}")
            try:
                httpx.get(base + "/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        process = psutil.Process(server.pid)
        warmup = drive(base, args.clients, args.warmup_seconds, seed=1000, repeats=repeats)
        health = wait_idle(base)
        start, spec_start = sample(process, health, pool_bytes), health["speculative"]
        maps_start = memory_by_mapping(server.pid)
        print("start", json.dumps(start), flush=True)
        rss: list[tuple[float, float, float, int]] = []
        started = time.monotonic()

        def sample_rss() -> None:
            while time.monotonic() < started + args.minutes * 60:
                done = len(soak_finished)
                rss_mb = process.memory_info().rss / 2**20
                kv_mb = kv_pool_resident(process.pid, pool_bytes)[0] / 2**20
                rss.append((round(time.monotonic() - started), round(rss_mb, 1), round(kv_mb, 1), done))
                load.append(os.getloadavg())
                time.sleep(WINDOW_S)

        soak = Tally()
        soak_finished = soak.finished
        threading.Thread(target=sample_rss, daemon=True).start()
        drive(base, args.clients, args.minutes * 60, seed=0, repeats=repeats, tally=soak)
        health = wait_idle(base)
        end = sample(process, health, pool_bytes)
        maps_end = memory_by_mapping(server.pid)
        children = process.children(recursive=True)
    finally:
        server.terminate()
        server.wait(30)
    time.sleep(3)  # compile workers notice their parent is gone within a second
    end["processes_left_after_stop"] = sum(child.is_running() for child in children)
    spec = {key: health["speculative"][key] - spec_start[key] for key in SPEC_COUNTERS}
    windows: dict[int, list[float]] = {}
    for when, latency in soak.finished:
        windows.setdefault(int((when - started) // WINDOW_S), []).append(latency)
    by_outcome: Counter[str] = Counter()
    for (_, outcome), count in soak.outcomes.items():
        by_outcome[outcome] += count
    failures = verdict(start, end, warmup, soak, spec)
    report = {
        "command": " ".join(sys.argv),
        "minutes": args.minutes,
        "clients": args.clients,
        "cpu": cpu_name(),
        "load_average_1_5_15_every_30s": [[round(x, 2) for x in sample] for sample in load],
        "requests": len(soak.finished),
        "failed_requests": sum(soak.problems.values()),
        "outcomes": dict(by_outcome.most_common()),
        "outcomes_by_kind": soak.by_kind(),
        "warmup_requests": len(warmup.finished),
        "warmup_failed_requests": sum(warmup.problems.values()),
        "repeats_checked": repeats.num_checked,
        "speculative_during_soak": spec,
        "speculative_at_end": health["speculative"],
        "start": start,
        "end": end,
        "growth": {key: round(end[key] - start[key], 1) for key in start},
        "rss_mb_kv_pool_resident_mb_requests_done_every_30s": rss,
        "memory_by_mapping_mb_start_end": [maps_start, maps_end],
        "p99_latency_s_first_last_window": [p99(windows[min(windows)]), p99(windows[max(windows)])],
        "scheduling": health["scheduling"],
        "problem_examples": warmup.examples + soak.examples,
        "failures": failures,
        "verdict": "FAIL" if failures else "PASS",
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if failures:
        print("FAIL: " + "; ".join(failures))
    else:
        print("PASS: every request as its kind must be, RSS outside the KV pool grew <= 5%, nothing in use when idle")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
