"""The seeds' scenario: one-at-a-time vs static batching vs in-flight batching, same run.

    .venv/bin/python bench/batching.py [--engine ENGINE_DIR] [--wave-gap 2.0]

Two waves of eight chat requests (~200-token prompts), forced output lengths
20, 25, 30, 40, 50, 60, 400, 600 in each wave (static/dynamic/continuous seed). Prints wall
time, output tokens/s, slot utilization, TTFT per request, the 600-step floor, and the
scheduler's own cost per step with 64 running requests (fake engine, no model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ifb import LLM, SamplingParams
from ifb.builder.build import BuildOptions
from ifb.find_or_build import find_or_build_engine
from ifb.runtime.executor import StepRecord
from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.policies import (
    CapacityPolicyKind,
    ChunkingPolicyKind,
    make_capacity_policy,
    make_chunking_policy,
)
from ifb.runtime.request import Request, RequestTimes
from ifb.runtime.scheduler import Scheduler, SchedulerConfig
from ifb.runtime.step_budget.budgets import FixedBudget, LatencyTargetBudget, StepBudget
from ifb.runtime.step_budget.cost_model import StepCostModel

OUTPUT_LENGTHS = (20, 25, 30, 40, 50, 60, 400, 600)
SYSTEM = "You are a careful assistant. Answer in detail, with examples, and explain each step of your reasoning. " * 9
TOPICS = [
    "paged attention",
    "in-flight batching",
    "KV caches",
    "rotary embeddings",
    "chunked prefill",
    "prefix caching",
    "speculative decoding",
    "quantization",
]
MODES = {
    "one_at_a_time": dict(max_batch_size=1),
    "static_batch": dict(max_batch_size=8, policy="static_batch"),
    "in_flight": dict(max_batch_size=8, policy="guaranteed_no_evict"),
}


@dataclass
class Finished:
    arrival: float
    ttft: float
    e2e: float
    tokens: int


def prompts(llm: LLM) -> list[list[int]]:
    out = []
    for topic in TOPICS:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Explain {topic} to a new engineer."},
        ]
        out.append(llm.apply_chat_template(messages))
    return out


def run_mode(engine: Path, options: dict, wave_gap: float) -> dict:
    with LLM(engine, max_queued_requests=64, **options) as llm:
        steps: list[StepRecord] = []
        llm.executor.step_listeners.append(steps.append)
        chat = prompts(llm)
        llm.generate([chat[0]], SamplingParams(max_tokens=2))  # warm-up
        steps.clear()
        done: list[Finished] = []
        lock = threading.Lock()
        all_done = threading.Event()
        total = 2 * len(OUTPUT_LENGTHS)

        def sink_for(arrival: float):
            first: list[float] = []

            def sink(output: RequestOutput) -> None:
                now = time.perf_counter()
                if output.new_token_ids and not first:
                    first.append(now)
                if output.finished:
                    with lock:
                        done.append(Finished(arrival, first[0] - arrival, now - arrival, output.num_output_tokens))
                        if len(done) == total:
                            all_done.set()

            return sink

        start = time.perf_counter()
        for wave in range(2):
            if wave:
                time.sleep(max(0.0, start + wave_gap - time.perf_counter()))
            for prompt, length in zip(chat, OUTPUT_LENGTHS, strict=True):
                params = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
                llm.submit(prompt, params, sink_for(time.perf_counter()))
        all_done.wait()
        wall = time.perf_counter() - start
        busy_seat_steps = sum(s.num_requests for s in steps)
        seats = options["max_batch_size"]
        return {
            "wall_s": wall,
            "steps": len(steps),
            "output_tokens": sum(f.tokens for f in done),
            "tokens_per_s": sum(f.tokens for f in done) / wall,
            "slot_utilization": busy_seat_steps / (seats * max(1, len(steps))),
            "mean_step_ms": 1000 * statistics.mean(s.end - s.start for s in steps),
            "ttft_s": sorted(round(f.ttft, 2) for f in done),
            "ttft_p50_s": statistics.median(f.ttft for f in done),
            "prompt_tokens": len(chat[0]),
        }


# Coefficients of the order `ifb build` measures for SmolLM2 fp32 (only the scheduler's own
# arithmetic is timed here, so their exact values do not matter).
EXAMPLE_COST = StepCostModel(30.0, 1.8, 1.5, 0.01, 0.0003)


def scheduler_cost_us(num_running: int = 64, steps: int = 2000, budget: StepBudget | None = None) -> float:
    """schedule() + update() with `num_running` decoding requests, no model."""
    kv = KVCacheManager(num_blocks=num_running * 64, block_size=16)
    scheduler = Scheduler(
        SchedulerConfig(num_running, 8192, 4096),
        kv,
        make_capacity_policy(CapacityPolicyKind.GUARANTEED_NO_EVICT, kv),
        make_chunking_policy(ChunkingPolicyKind.FIRST_COME_FIRST_SERVED),
        budget or FixedBudget(),
    )
    for i in range(num_running):
        scheduler.add(
            Request(
                f"r{i}",
                list(range(100 + i, 300 + i)),
                200,
                SamplingParams(max_tokens=3000, ignore_eos=True),
                3000,
                RequestTimes(0.0),
            )
        )
    for _ in range(2):  # prefill everyone
        batch = scheduler.schedule()
        scheduler.update(batch, {r.request_id: [5] for r in batch.requests if r.sample})
    start = time.perf_counter()
    for _ in range(steps):
        batch = scheduler.schedule()
        scheduler.update(batch, {r.request_id: [5] for r in batch.requests})
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None)
    parser.add_argument("--wave-gap", type=float, default=2.0, help="seconds between the two waves")
    parser.add_argument("--output", type=Path, default=Path("bench/out/batching.json"))
    args = parser.parse_args()
    engine = Path(args.engine or find_or_build_engine(None, BuildOptions(max_batch_size=32, max_num_tokens=512)))
    results = {name: run_mode(engine, options, args.wave_gap) for name, options in MODES.items()}
    inflight, static = results["in_flight"], results["static_batch"]
    floor_s = args.wave_gap + max(OUTPUT_LENGTHS) * inflight["mean_step_ms"] / 1000
    print(
        f"{'mode':16s}{'wall s':>9s}{'steps':>7s}{'tok/s':>8s}{'slots':>7s}{'step ms':>9s}{'TTFT p50':>10s}   TTFT per request (s)"
    )
    for name, r in results.items():
        print(
            f"{name:16s}{r['wall_s']:9.1f}{r['steps']:7d}{r['tokens_per_s']:8.1f}{r['slot_utilization']:7.0%}{r['mean_step_ms']:9.1f}{r['ttft_p50_s']:10.2f}   {r['ttft_s']}"
        )
    print(
        f"prompt {inflight['prompt_tokens']} tokens; floor = wave gap + 600 steps at the in-flight step time = {floor_s:.1f} s"
    )
    print(
        f"in-flight vs floor: {inflight['wall_s'] / floor_s:.2f}x   in-flight vs static: {static['wall_s'] / inflight['wall_s']:.2f}x faster   vs one-at-a-time: {results['one_at_a_time']['wall_s'] / inflight['wall_s']:.2f}x"
    )
    cost = scheduler_cost_us()
    print(
        f"scheduler schedule+update, 64 running: {cost:.0f} us per step = {100 * cost / 1000 / inflight['mean_step_ms']:.1f}% of an in-flight step"
    )
    targeted = scheduler_cost_us(budget=LatencyTargetBudget(EXAMPLE_COST, 200.0, 16))
    print(
        f"  with a 200 ms latency target: {targeted:.0f} us per step = {100 * targeted / 1000 / inflight['mean_step_ms']:.1f}% of an in-flight step"
    )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {"results": results, "floor_s": floor_s, "scheduler_us_64": cost, "scheduler_us_64_itl_target": targeted},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
