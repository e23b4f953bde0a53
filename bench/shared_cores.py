"""How loaded models share the cores, in one process through the Python API (no HTTP, no clients
competing for the cores): one busy model alone, the same with a second model loaded and idle, and
both busy at once.

    .venv/bin/python bench/shared_cores.py --engine ENGINE_DIR [--repeats 3] [--batch 8] [--tokens 48]

Each phase generates BATCH copies of one prompt, TOKENS tokens each (ignore_eos, greedy) on each
busy model; output tok/s is the tokens over the phase's wall time, and tokens per process CPU
second is the figure a shared machine disturbs least. The phases alternate REPEATS times after a
warm-up, and the medians are printed with the ratios: `idle_second / alone` (what an idle loaded
model costs a busy one) and `two / alone` (total output of two busy models against one).
The machine's load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

from ifb import LLM
from ifb.runtime.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def load_average() -> list[float]:
    with open("/proc/loadavg") as f:
        return [float(x) for x in f.read().split()[:3]]


def timed(work: Callable[[], int]) -> tuple[float, float, int]:
    """(wall s, process CPU s, tokens) of `work`."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = work()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def generate(llm: LLM, batch: int, params: SamplingParams) -> int:
    return sum(len(output.token_ids) for output in llm.generate([PROMPT] * batch, params))


def together(llms: list[LLM], batch: int, params: SamplingParams) -> int:
    counts = [0] * len(llms)

    def run(i: int) -> None:
        counts[i] = generate(llms[i], batch, params)

    callers = [threading.Thread(target=run, args=(i,)) for i in range(len(llms))]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    return sum(counts)


def rates(samples: list[tuple[float, float, int]]) -> dict[str, float]:
    return {
        "tok_per_s": round(statistics.median(t / w for w, _, t in samples), 1),
        "tok_per_cpu_s": round(statistics.median(t / c for _, c, t in samples), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    print(json.dumps({"load_avg_before": load_average(), "batch": args.batch, "tokens": args.tokens}), flush=True)
    phases: dict[str, list[tuple[float, float, int]]] = {"alone": [], "idle_second": [], "two": []}
    with LLM(args.engine) as first:
        generate(first, args.batch, params)  # warm-up
        for _ in range(args.repeats):
            phases["alone"].append(timed(lambda: generate(first, args.batch, params)))
        with LLM(args.engine) as second:
            generate(second, args.batch, params)  # warm-up: the second model has stepped once
            for _ in range(args.repeats):
                phases["idle_second"].append(timed(lambda: generate(first, args.batch, params)))
                phases["two"].append(timed(lambda: together([first, second], args.batch, params)))
    result = {name: rates(samples) for name, samples in phases.items()}
    alone = result["alone"]["tok_per_s"]
    result["idle_second / alone"] = round(result["idle_second"]["tok_per_s"] / alone, 2)
    result["two / alone"] = round(result["two"]["tok_per_s"] / alone, 2)
    result["load_avg_after"] = load_average()  # type: ignore[assignment]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
