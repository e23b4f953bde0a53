"""Speculative decoding: off vs ngram (prompt lookup) vs suffix (recent requests too), same engine, same run.

    .venv/bin/python bench/speculative.py [--engine ENGINE_DIR] [--rounds 3] [--max-tokens 128]
                                          [--clients 16,32] [--requests-per-client 2] [--quick]

Greedy chat prompts (the engine's chat template), at most --max-tokens output tokens each (an
end-of-sequence token still ends a request, so every mode does the same work), through the
Python API in-process (`LLM(..., speculative=MODE, calibrate=True)`: the step cost model the
planner sizes drafts with is measured on this machine at start). Workloads:

  edit      single stream: rewrite a function with type hints, quote a passage, reformat JSON,
            fix typos, extract fields -- the answer copies text of the prompt
  chat      single stream: open questions and stories, nothing to copy
  agent     single stream: an agent loop's requests one after another, each a weather tool
            result for one city in one JSON template (only the readings vary) to be reported in
            one sentence -- the answer repeats earlier requests' answers, which the suffix cache
            (per cache_salt; all these requests share one) has seen and ngram has not
  mixed-N   N concurrent streams (asyncio, LLM.astream), each sending --requests-per-client
            requests of all three kinds one after another; N > the engine's seats waits for one.
            The agent requests share a cache_salt, every other request has its own (the short
            prompt list recurs; suffix must not copy a recurring prompt's earlier answer)

Each single-stream workload has its own cache_salt per round.

Modes run alternately, one LLM at a time (a fresh instance per round and mode, so the suffix
cache starts empty each round; two live executors on two cores slow each other down): round 1
off, ngram, suffix; round 2 ngram, suffix, off; ... Timings are the least disturbed ones (a
neighbour on a shared machine only ever slows a run): each request's fastest round (single
stream) or the fastest round (mixed); `pooled` is all rounds together and `(by round)` each round
against off's run of that round; counters are summed over all rounds. Per mode:

  tok/s         output tokens / wall time (single stream: each request's send to last token, TTFT
                included)
  TPOT          per request, (last delta - first delta) / tokens after the first delta, pooled
  gap / p99     gaps between a request's consecutive streamed deltas (a delta carries every token
                a step kept: 1 + accepted drafts), pooled over requests; p99 is the ITL p99
  tok/delta     output tokens per delta after the first
  tok/step      engine counters: generation_tokens / num_steps over the workload (prefill steps too)
  accept        spec_num_accepted_tokens / spec_num_draft_tokens
  acc len       spec_num_accepted_tokens / spec_num_drafts (mean accepted draft length)
  mismatch      requests whose greedy tokens differ from the off mode's for the same prompt (round
                1, single stream): speculation must not change output, nor batching

Prints one markdown table and the targets, writes bench/out/speculative.json (with each instance's
calibrated cost model and the 1-minute load average around it). Without --engine it finds or
builds a SmolLM2 Q4_1 `--compute int8` engine (16 seats). The full run takes ~6 minutes on 2
quiet cores; `--quick` (3 edit, 3 chat, 5 agent prompts, 1 request per client) ~4.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from ifb import LLM, SamplingParams
from ifb.builder.build import BuildOptions
from ifb.find_or_build import find_or_build_engine
from ifb.runtime.scheduler_stats import SchedulerCounters

MODES = ("off", "ngram", "suffix")
COUNTERS = (
    "num_steps",
    "generation_tokens",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_num_emitted_tokens",
)

# -- workloads ----------------------------------------------------------------------------------

FUNCTION = '''def summarize_orders(orders, currency, min_total=0, include_refunds=False):
    """Group orders by customer and total them."""
    totals = {}
    counts = {}
    for order in orders:
        if order["status"] == "cancelled":
            continue
        if order["status"] == "refunded" and not include_refunds:
            continue
        customer = order["customer_id"]
        amount = order["amount"]
        if order["currency"] != currency:
            amount = convert(amount, order["currency"], currency)
        totals[customer] = totals.get(customer, 0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    result = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        result.append(
            {
                "customer_id": customer,
                "total": round(total, 2),
                "orders": counts[customer],
                "average": round(average, 2),
            }
        )
    result.sort(key=lambda row: row["total"], reverse=True)
    return result'''

CLASS = """class RateLimiter:
    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated = time.monotonic()

    def allow(self, cost=1):
        now = time.monotonic()
        elapsed = now - self.updated
        self.updated = now
        self.tokens = min(self.burst, self.tokens + elapsed * self.rate)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def wait_time(self, cost=1):
        if self.tokens >= cost:
            return 0.0
        return (cost - self.tokens) / self.rate"""

PASSAGE = (
    "The Great Barrier Reef is the world's largest coral reef system, composed of over 2,900 individual "
    "reefs and 900 islands stretching for over 2,300 kilometres over an area of approximately 344,400 square "
    "kilometres. The reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be seen "
    "from outer space and is the world's biggest single structure made by living organisms. This reef "
    "structure is composed of and built by billions of tiny organisms, known as coral polyps. It supports a "
    "wide diversity of life and was selected as a World Heritage Site in 1981."
)

JSON_TEXT = (
    '{"id": 4821, "name": "Ada Lovelace", "email": "ada@example.com", "roles": ["admin", "editor"], '
    '"address": {"street": "12 St James Square", "city": "London", "postcode": "SW1Y 4JH", "country": "UK"}, '
    '"active": true, "last_login": "2026-11-30T09:14:00Z", "preferences": {"theme": "dark", "language": "en", '
    '"notifications": {"email": true, "sms": false}}}'
)

TYPOS = (
    "Teh quarterly report shows that revenue grew by twelve percent compared to the previus quarter. "
    "Most of the growth came from the new subscription plan, wich launched in September. Costs stayed "
    "flat, so the operating margin improved to eighteen percent. The team recomends expanding the plan "
    "to two more regions next year."
)

CONTACTS = (
    "From: Maria Gonzalez <maria.gonzalez@northwind.com>\nTo: support@contoso.com\nCc: james.lee@northwind.com\n"
    "Subject: Order 77413 arrived damaged\n\nHello, our order 77413 arrived on 28 November with two broken "
    "units. Please call me at +1 415 555 0132 or email maria.gonzalez@northwind.com. Our account number is "
    "NW-20931.\nThanks, Maria"
)

EDIT_PROMPTS = (
    f"Rewrite this Python function adding type hints. Return only the code.\n\n```python\n{FUNCTION}\n```",
    f"Answer by quoting the passage exactly.\n\nPassage: {PASSAGE}\n\nQuestion: Where is the Great Barrier Reef "
    "and what is it built by?",
    f"Reformat this JSON with 2-space indentation:\n\n{JSON_TEXT}",
    f"Fix the spelling mistakes in this paragraph and return the whole paragraph:\n\n{TYPOS}",
    f"Add type hints and a docstring to every method of this class. Return the full class.\n\n```python\n{CLASS}\n```",
    f"Extract the sender name, sender email, order number, phone number and account number from this "
    f"email, one per line as 'field: value'.\n\n{CONTACTS}",
)

CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue.",
    "Give me three tips for learning to play the guitar.",
    "What are the benefits of regular exercise?",
    "Describe a day in the life of a honeybee.",
    "Write a poem about autumn in the mountains.",
)

AGENT_SYSTEM = (
    "You are a weather assistant. The user asks about the weather and the get_weather tool result follows. "
    "Reply with exactly one sentence of this form and nothing else: "
    "'Right now in <city> it is <temperature> degrees Celsius and <condition>, with humidity at <humidity> "
    "percent and wind from the <wind_direction> at <wind_speed> km/h.'"
)
CONDITIONS = ("cloudy", "sunny", "light rain", "clear", "snow", "partly cloudy", "windy", "foggy")
DIRECTIONS = ("north", "south-west", "east", "north-east", "west", "south")


def agent_messages(index: int) -> list[dict[str, str]]:
    city, country = "Paris", "FR"  # one agent polling one place: only the readings change
    result = {
        "tool": "get_weather",
        "status": "ok",
        "location": {"city": city, "country": country},
        "current": {
            "temperature_c": 3 + (index * 7) % 29,
            "condition": CONDITIONS[index % len(CONDITIONS)],
            "humidity_pct": 35 + (index * 11) % 60,
            "wind_kmh": 4 + (index * 5) % 37,
            "wind_direction": DIRECTIONS[index % len(DIRECTIONS)],
        },
        "units": "metric",
    }
    return [
        {"role": "system", "content": AGENT_SYSTEM},
        {
            "role": "user",
            "content": f"What is the weather like in {city} right now?\n\nget_weather result:\n{json.dumps(result)}",
        },
    ]


@dataclass(frozen=True)
class Job:
    key: str  # one prompt: outputs of the same key must be token-identical in every mode and run
    messages: list[dict[str, str]]
    loop: bool = False  # one of an agent loop's requests: in the mixed runs they share a cache_salt


def workloads(quick: bool) -> dict[str, list[Job]]:
    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    edits = EDIT_PROMPTS[:3] if quick else EDIT_PROMPTS
    chats = CHAT_PROMPTS[:3] if quick else CHAT_PROMPTS
    num_agent = 5 if quick else 10
    return {
        "edit": [Job(f"edit{i}", user(p)) for i, p in enumerate(edits)],
        "chat": [Job(f"chat{i}", user(p)) for i, p in enumerate(chats)],
        "agent": [Job(f"agent{i}", agent_messages(i), loop=True) for i in range(num_agent)],
    }


# -- measuring ----------------------------------------------------------------------------------


@dataclass
class Trace:
    """One request as its client saw it: when each delta with tokens arrived, and the tokens."""

    key: str
    sent: float
    times: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)

    def add(self, new_token_ids: Sequence[int]) -> None:
        if new_token_ids:
            self.times.append(time.perf_counter())
            self.counts.append(len(new_token_ids))
            self.token_ids.extend(new_token_ids)


@dataclass
class Run:
    """One workload in one mode and round."""

    wall_s: float
    traces: list[Trace]
    counters: dict[str, int]


def counter_diff(before: SchedulerCounters, after: SchedulerCounters) -> dict[str, int]:
    return {name: getattr(after, name) - getattr(before, name) for name in COUNTERS}


def measured(llm: LLM, body: Callable[[], list[Trace]]) -> Run:
    before = llm.stats().counters
    start = time.perf_counter()
    traces = body()
    wall = time.perf_counter() - start
    time.sleep(0.05)  # the snapshot is published after the last delta's step
    return Run(wall, traces, counter_diff(before, llm.stats().counters))


def single_stream(llm: LLM, jobs: list[Job], params: SamplingParams) -> list[Trace]:
    traces = []
    for job in jobs:
        ids = llm.apply_chat_template(job.messages)
        trace = Trace(job.key, time.perf_counter())
        for output in llm.stream(ids, params):
            trace.add(output.new_token_ids)
        traces.append(trace)
    return traces


def concurrent(llm: LLM, client_jobs: list[list[Job]], params: SamplingParams) -> list[Trace]:
    """One asyncio task per client, each sending its requests one after another. The agent
    loop's requests share the run's cache_salt; every other request gets its own: a prompt that
    recurs here only because the prompt list is short must not let suffix copy its earlier
    answer (nor reuse its KV blocks, in any mode)."""
    prompts = {job.key: llm.apply_chat_template(job.messages) for jobs in client_jobs for job in jobs}
    salt = params.cache_salt

    async def client(index: int, jobs: list[Job]) -> list[Trace]:
        traces = []
        for number, job in enumerate(jobs):
            own = replace(params, cache_salt=salt if job.loop else f"{salt}-client{index}-{number}")
            trace = Trace(job.key, time.perf_counter())
            async for output in llm.astream(prompts[job.key], own):
                trace.add(output.new_token_ids)
            traces.append(trace)
        return traces

    async def main() -> list[Trace]:
        done = await asyncio.gather(*(client(i, jobs) for i, jobs in enumerate(client_jobs)))
        return [trace for traces in done for trace in traces]

    return asyncio.run(main())


def mixed_clients(jobs: list[Job], num_clients: int, per_client: int) -> list[list[Job]]:
    """Client i takes jobs i, i + N, ... round-robin over the pooled list (every kind in flight)."""
    return [[jobs[(i + j * num_clients) % len(jobs)] for j in range(per_client)] for i in range(num_clients)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(runs: list[Run], timing: list[Run] | None = None) -> dict[str, float]:
    """Counters over `runs`; timings over `timing` (default the same runs)."""
    traces = [t for run in (timing or runs) for t in run.traces if t.times]
    tokens = sum(len(t.token_ids) for t in traces)
    wall = sum(run.wall_s for run in (timing or runs))
    gaps = [b - a for t in traces for a, b in zip(t.times, t.times[1:], strict=False)]
    decode_s = sum(t.times[-1] - t.times[0] for t in traces)
    decode_tokens = sum(sum(t.counts[1:]) for t in traces)
    later_deltas = sum(len(t.counts) - 1 for t in traces)
    c = {name: sum(run.counters[name] for run in runs) for name in COUNTERS}
    return {
        "requests": len(traces),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "tpot_ms": 1000 * decode_s / decode_tokens if decode_tokens else float("nan"),
        "gap_mean_ms": 1000 * statistics.fmean(gaps) if gaps else float("nan"),
        "itl_p50_ms": 1000 * percentile(gaps, 0.50),
        "itl_p99_ms": 1000 * percentile(gaps, 0.99),
        "ttft_p50_ms": 1000 * percentile([t.times[0] - t.sent for t in traces], 0.50),
        "tokens_per_delta": decode_tokens / later_deltas if later_deltas else float("nan"),
        "tokens_per_step": c["generation_tokens"] / c["num_steps"] if c["num_steps"] else float("nan"),
        "acceptance": c["spec_num_accepted_tokens"] / c["spec_num_draft_tokens"]
        if c["spec_num_draft_tokens"]
        else float("nan"),
        "accepted_length": c["spec_num_accepted_tokens"] / c["spec_num_drafts"]
        if c["spec_num_drafts"]
        else float("nan"),
        **c,
    }


def fastest(runs: list[Run], single_stream: bool) -> list[Run]:
    """The least disturbed timings of a mode: each request's fastest round (single stream: a
    request is sent alone, and a neighbour's burst on a shared machine only ever slows it), or
    the fastest round (concurrent: a round's requests share every step)."""
    if not single_stream:
        return [max(runs, key=lambda run: sum(len(t.token_ids) for t in run.traces) / run.wall_s)]
    best: dict[str, tuple[float, Trace]] = {}
    for run in runs:
        for trace in run.traces:
            e2e = trace.times[-1] - trace.sent if trace.times else float("inf")
            if trace.key not in best or e2e < best[trace.key][0]:
                best[trace.key] = (e2e, trace)
    return [Run(sum(e2e for e2e, _ in best.values()), [t for _, t in best.values()], {})]


# -- the run ------------------------------------------------------------------------------------


def run_mode(
    engine: Path, mode: str, round_index: int, jobs: dict[str, list[Job]], args: argparse.Namespace
) -> tuple[dict[str, Run], dict[str, Any]]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    started = time.perf_counter()
    llm = LLM(
        engine,
        speculative=mode,
        **({} if args.num_speculative_tokens is None else {"num_speculative_tokens": args.num_speculative_tokens}),
        calibrate=not args.no_calibrate,
        max_batch_size=args.max_batch_size,
    )
    info: dict[str, Any] = {"load_s": time.perf_counter() - started, "loadavg_1m_start": os.getloadavg()[0]}
    try:
        cost_model = llm.executor.scheduler.step_budget.report().cost_model
        info["cost_model"] = None if cost_model is None else asdict(cost_model)
        llm.generate(  # warm the step outside the measured runs
            [llm.apply_chat_template([{"role": "user", "content": "Hello"}])],
            SamplingParams(max_tokens=8, temperature=0.0, cache_salt="warmup"),
        )
        runs: dict[str, Run] = {}
        for name in ("edit", "chat", "agent"):  # one cache_salt per workload and round
            own = replace(params, cache_salt=f"round{round_index}-{name}")
            runs[name] = measured(llm, partial(single_stream, llm, jobs[name], own))
        pooled = [job for name in ("edit", "chat", "agent") for job in jobs[name]]
        for num_clients in args.clients:
            clients = mixed_clients(pooled, num_clients, args.requests_per_client)
            own = replace(params, cache_salt=f"round{round_index}-mixed-{num_clients}")
            runs[f"mixed-{num_clients}"] = measured(llm, partial(concurrent, llm, clients, own))
    finally:
        llm.close()
    info["total_s"] = time.perf_counter() - started
    info["loadavg_1m_end"] = os.getloadavg()[0]
    return runs, info


def mismatches(results: dict[str, dict[str, list[Run]]]) -> dict[str, dict[str, Any]]:
    """Per mode and workload: requests whose tokens differ from off's round-1 single-stream
    output of the same prompt (and, for the first few, where they first differ)."""
    reference = {t.key: t.token_ids for name in ("edit", "chat", "agent") for t in results["off"][name][0].traces}
    report: dict[str, dict[str, Any]] = {}
    for mode, workloads_runs in results.items():
        for name, runs in workloads_runs.items():
            differing = []
            for round_index, run in enumerate(runs):
                for trace in run.traces:
                    want = reference[trace.key]
                    if trace.token_ids != want:
                        at = next(
                            (i for i, (a, b) in enumerate(zip(trace.token_ids, want, strict=False)) if a != b),
                            min(len(trace.token_ids), len(want)),
                        )
                        differing.append({"round": round_index + 1, "key": trace.key, "first_difference": at})
            total = sum(len(run.traces) for run in runs)
            report.setdefault(mode, {})[name] = {"requests": total, "differing": len(differing), "cases": differing[:8]}
    return report


def fmt(value: float, spec: str) -> str:
    return "—" if value != value else format(value, spec)  # NaN: no drafts (off)


def by_round(results: dict[str, dict[str, list[Run]]], mode: str, name: str, metric: str) -> str:
    """The mode's ratio to off in each round (off's run of the same round), as 'r1/r2/...'."""
    pairs = zip(results[mode][name], results["off"][name], strict=True)
    return "/".join(f"{summarize([run])[metric] / summarize([off])[metric]:.2f}" for run, off in pairs)


Rows = dict[str, dict[str, dict[str, float]]]  # mode -> workload -> metric -> value


def print_table(
    best: Rows, pooled: Rows, diffs: dict[str, dict[str, Any]], results: dict[str, dict[str, list[Run]]]
) -> None:
    print(
        "| workload | mode | tok/s | × off | pooled × off (by round) | TPOT ms | gap mean ms | ITL p99 ms | p99 × off "
        "| pooled p99 × off (by round) | tok/delta | tok/step | accept | acc len | mismatch |"
    )
    print("| --- " * 15 + "|")
    for name in best["off"]:
        off, off_pooled = best["off"][name], pooled["off"][name]
        for mode in MODES:
            row, row_pooled = best[mode][name], pooled[mode][name]
            diff = diffs[mode][name]
            tps, p99 = (
                row_pooled["tokens_per_s"] / off_pooled["tokens_per_s"],
                row_pooled["itl_p99_ms"] / off_pooled["itl_p99_ms"],
            )
            pooled_tps = "" if mode == "off" else f"{tps:.2f} ({by_round(results, mode, name, 'tokens_per_s')})"
            pooled_p99 = "" if mode == "off" else f"{p99:.2f} ({by_round(results, mode, name, 'itl_p99_ms')})"
            print(
                f"| {name} | {mode} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / off['tokens_per_s']:.2f} "
                f"| {pooled_tps} | {row['tpot_ms']:.1f} | {row['gap_mean_ms']:.1f} | {row['itl_p99_ms']:.1f} "
                f"| {row['itl_p99_ms'] / off['itl_p99_ms']:.2f} | {pooled_p99} | {row['tokens_per_delta']:.2f} "
                f"| {row['tokens_per_step']:.2f} | {fmt(row['acceptance'], '.2f')} | {fmt(row['accepted_length'], '.2f')} "
                f"| {diff['differing']}/{diff['requests']} |"
            )


def targets(best: Rows, pooled: Rows, clients: list[int]) -> list[tuple[str, bool, str]]:
    """Judged on the fastest timings; the pooled ratio alongside."""
    checks = []

    def check(what: str, mode: str, name: str, holds: Callable[[float], bool], metric: str, over: str = "off") -> None:
        value = best[mode][name][metric] / best[over][name][metric]
        value_pooled = pooled[mode][name][metric] / pooled[over][name][metric]
        checks.append((what, holds(value), f"{value:.2f}x; pooled {value_pooled:.2f}x"))

    tps, p99 = "tokens_per_s", "itl_p99_ms"
    for mode in ("ngram", "suffix"):
        check(f"edit, {mode}: tok/s >= 2x off", mode, "edit", lambda v: v >= 2.0, tps)
        check(f"chat, {mode}: tok/s >= 0.97x off", mode, "chat", lambda v: v >= 0.97, tps)
    check("agent: suffix tok/s > ngram", "suffix", "agent", lambda v: v > 1.0, tps, over="ngram")
    for n in clients:
        for mode in ("ngram", "suffix"):
            check(f"mixed-{n}, {mode}: tok/s >= 0.98x off", mode, f"mixed-{n}", lambda v: v >= 0.98, tps)
            check(f"mixed-{n}, {mode}: ITL p99 <= 1.1x off", mode, f"mixed-{n}", lambda v: v <= 1.1, p99)
    return checks


def git(*arguments: str) -> str:
    return subprocess.run(["git", *arguments], capture_output=True, text=True).stdout


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    words = set(text.split())
    return sorted(w for w in words if w == "avx2" or w.startswith(("avx512", "amx")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None, help="default: a SmolLM2 Q4_1 --compute int8 engine, built if none")
    parser.add_argument("--rounds", type=int, default=3, help="each mode runs once per round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="default: the runtime's")
    parser.add_argument("--max-batch-size", type=int, default=None, help="seats (default: the engine's)")
    parser.add_argument("--clients", default="16,32", help="concurrent streams of the mixed workload")
    parser.add_argument("--requests-per-client", type=int, default=None, help="default 2, quick 1")
    parser.add_argument("--no-calibrate", action="store_true", help="use engine.json's recorded cost model")
    parser.add_argument("--quick", action="store_true", help="3 edit, 3 chat, 5 agent prompts; 1 request per client")
    parser.add_argument("--output", type=Path, default=Path("bench/out/speculative.json"))
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",") if c]
    args.requests_per_client = args.requests_per_client or (1 if args.quick else 2)
    jobs = workloads(args.quick)
    options = BuildOptions(max_batch_size=16, max_num_tokens=512, compute="int8")
    args.engine = Path(args.engine or find_or_build_engine(None, options))

    results: dict[str, dict[str, list[Run]]] = {mode: {} for mode in MODES}
    infos: list[dict[str, Any]] = []
    for round_index in range(args.rounds):
        order = MODES[round_index % len(MODES) :] + MODES[: round_index % len(MODES)]
        for mode in order:
            runs, info = run_mode(args.engine, mode, round_index, jobs, args)
            for name, run in runs.items():
                results[mode].setdefault(name, []).append(run)
            infos.append({"round": round_index + 1, "mode": mode, **info})
            line = ", ".join(
                f"{n} {sum(len(t.token_ids) for t in r.traces) / r.wall_s:.1f} tok/s" for n, r in runs.items()
            )
            load = f"load {info['loadavg_1m_start']:.1f}-{info['loadavg_1m_end']:.1f}"
            print(
                f"round {round_index + 1} {mode:6s} ({info['total_s']:.0f} s, {load}): {line}",
                file=sys.stderr,
                flush=True,
            )

    single = {"edit", "chat", "agent"}
    best = {
        m: {n: summarize(runs, fastest(runs, n in single)) for n, runs in per.items()} for m, per in results.items()
    }
    pooled = {m: {n: summarize(runs) for n, runs in per.items()} for m, per in results.items()}
    diffs = mismatches(results)
    checks = targets(best, pooled, args.clients)
    print()
    print_table(best, pooled, diffs, results)
    print()
    for what, ok, value in checks:
        print(f"- {'met' if ok else 'MISSED'}: {what} ({value})")
    total_diff = sum(d["differing"] for per in diffs.values() for d in per.values())
    print(f"- greedy outputs differing from off's: {total_diff}")
    command = " ".join(["python", "bench/speculative.py", *sys.argv[1:]])
    print(f"\nreproduce: .venv/bin/{command}")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": command,
        "engine": str(args.engine),
        "git_revision": git("rev-parse", "HEAD").strip(),
        # the runtime measured is the working tree's: name what differs from the revision
        "git_modified": git("diff", "--name-only", "HEAD").split(),
        "git_diff_sha256": hashlib.sha256(git("diff", "HEAD").encode()).hexdigest(),
        "cpu": {"machine": platform.machine(), "flags": cpu_flags()},
        "settings": {f: getattr(args, f) for f in ("rounds", "max_tokens", "num_speculative_tokens", "clients")}
        | {"requests_per_client": args.requests_per_client, "quick": args.quick},
        "instances": infos,
        "results_fastest": best,
        "results_pooled": pooled,
        "by_round": {
            m: {n: [summarize([run]) for run in runs] for n, runs in per.items()} for m, per in results.items()
        },
        "mismatches": diffs,
        "targets": [{"target": what, "met": ok, "value": value} for what, ok, value in checks],
    }
    args.output.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
