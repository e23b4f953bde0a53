"""Step time of two or more compiled engines, loaded in one process and alternated (issue #39's
"step time must not get worse", within 3%).

    .venv/bin/python bench/step_ab.py OLD_ENGINE NEW_ENGINE [--rounds 6]

Engines built from the same file by two revisions of ifb (bench/compile_ab.py keeps none; build
each with `ifb build -o DIR --calibration serve` at its revision) are timed on the same inputs:
decode at batch 1, 8 and 32 (or the engine's max batch; CONTEXT tokens each, as bench/step.py), a mixed step (7 decode rows and a
128-token chunk after 64 cached tokens) and a 512-token prefill. Each round takes the median of a
few steps per shape and engine, the engines' steps interleaved one by one, so drift in the
machine's load falls on all of them; the table gives each engine's median over rounds, every
round's figure, and the median of its per-round ratios to the first engine with the rounds it was
slower in.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from step import CONTEXT, PREFILL, decode_inputs

from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, StepInputs, build_step_inputs

MIXED_CHUNK, MIXED_CACHED, MIXED_DECODE_ROWS = 128, 64, 7


def shapes(engine: Engine) -> dict[str, tuple[StepInputs, int]]:
    """Each timed shape's inputs and the steps a round times of it."""
    bs, vocab = engine.config.limits.block_size, engine.config.spec.vocab_size
    blocks = -(-(CONTEXT + 1) // bs)
    mixed = [
        RequestSlice([(5 + 7 * b) % vocab], CONTEXT, list(range(b * blocks, (b + 1) * blocks)), True)
        for b in range(MIXED_DECODE_ROWS)
    ]
    first = MIXED_DECODE_ROWS * blocks
    chunk_blocks = -(-(MIXED_CACHED + MIXED_CHUNK) // bs)
    chunk = [(100 + i) % vocab for i in range(MIXED_CHUNK)]
    mixed.append(RequestSlice(chunk, MIXED_CACHED, list(range(first, first + chunk_blocks)), True))
    prefill = [RequestSlice([(100 + i) % vocab for i in range(PREFILL)], 0, list(range(PREFILL // bs)), True)]
    widest = min(32, engine.config.limits.max_batch_size)  # #39 asks for 32; default engines seat 16
    return {
        "decode_b1": (decode_inputs(engine, 1), 30),
        "decode_b8": (decode_inputs(engine, 8), 30),
        f"decode_b{widest}": (decode_inputs(engine, widest), 20),
        f"mixed_{MIXED_CHUNK}+{MIXED_DECODE_ROWS}": (build_step_inputs(mixed, bs), 15),
        f"prefill_{PREFILL}": (build_step_inputs(prefill, bs), 5),
    }


def interleaved_ms(steps: list[Callable[[], object]], repeats: int) -> list[float]:
    """Each step's median time (ms) over `repeats`, the steps run in turn one at a time (A B A B ...),
    so a change in the machine's speed state falls on all of them alike: this 2-core EPYC switches
    between two (decode b1 ~5 or ~7 ms), and timing one engine's repeats after the other's put whole
    rounds of one engine in the other state (per-round ratios of 0.83-1.28 at b8)."""
    for step in steps * 2:
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for index, step in enumerate(steps):
            start = time.perf_counter()
            step()
            times[index].append(time.perf_counter() - start)
    return [1000 * statistics.median(each) for each in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    engines = {folder: Engine.load(folder, StepMode.COMPILED) for folder in args.engines}
    inputs = {folder: shapes(engine) for folder, engine in engines.items()}
    first = args.engines[0]
    times: dict[tuple[str, Path], list[float]] = {}
    for _ in range(args.rounds):
        for name, (_, repeats) in inputs[first].items():
            steps = [lambda e=engine, x=inputs[folder][name][0]: e.step(x) for folder, engine in engines.items()]
            for folder, ms in zip(engines, interleaved_ms(steps, repeats), strict=True):
                times.setdefault((name, folder), []).append(ms)
    for name in inputs[first]:
        base = times[(name, first)]
        for folder in args.engines:
            rounds = times[(name, folder)]
            ratios = [ms / b for ms, b in zip(rounds, base, strict=True)]
            slower = sum(r > 1 for r in ratios)
            figures = " ".join(f"{ms:.2f}" for ms in rounds)
            print(
                f"{name:14s} {str(folder):28s} {statistics.median(rounds):8.2f} ms  "
                f"x{statistics.median(ratios):.3f} (median of the rounds' ratios; slower in {slower}/{len(rounds)} rounds)"
                f"  rounds: {figures}"
            )


if __name__ == "__main__":
    main()
