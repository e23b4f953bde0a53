"""One-row tiles A/B: an engine's compiled decode steps with its kernel library streaming one column
tile at a time in one-row int8 passes, against the library's wide count (4 on AVX-512, 2 on AVX2),
alternated in one process on one engine.

    .venv/bin/python bench/one_row_tiles.py --engine ENGINE [--batches 1 8 16] [--rounds 5] [--repeats 15]

A one-row pass is every decode step at batch 1, and, in a mixture of experts, every expert that
one row of the step selected (most of them up to batch ~16). The library picks the count by CPU
(quant_matmul_int8.cpp: one tile on AMD, the wide count elsewhere); this script sets each in turn
(plugins/quant_build.py: set_one_row_tiles) and checks both give the same logits bit for bit.
Per batch and side: the median of `--repeats` steps per round, then the median over rounds.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import CONTEXT, decode_inputs, median_ms  # noqa: E402

from ifb.plugins.quant_build import one_row_tiles, set_one_row_tiles, wide_one_row_tiles  # noqa: E402
from ifb.runtime.step.backend import StepMode  # noqa: E402
from ifb.runtime.step.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    engine = Engine.load(args.engine, StepMode.COMPILED)
    library = engine.config.kernels_path
    if library is None:
        raise SystemExit(f"{args.engine} has no block-quantized kernel library: no one-row int8 passes to compare")
    default, wide = one_row_tiles(library), wide_one_row_tiles(library)
    sides = {"one tile": 1, f"{wide} tiles": wide}
    blocks = -(-(CONTEXT + 1) // engine.config.limits.block_size)
    batches = [b for b in args.batches if b * blocks <= engine.config.limits.num_kv_blocks]
    inputs = {batch: decode_inputs(engine, batch) for batch in batches}
    times: dict[tuple[str, int], list[float]] = {(side, b): [] for side in sides for b in batches}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    try:
        for _ in range(args.rounds):
            for side, tiles in sides.items():
                set_one_row_tiles(library, tiles)
                for batch in batches:
                    logits[side, batch] = engine.step(inputs[batch]).clone()
                    times[side, batch].append(median_ms(lambda b=batch: engine.step(inputs[b]), args.repeats))
    finally:
        set_one_row_tiles(library, None)
    load = os.getloadavg()[0]
    print(
        f"{args.engine.name}: {engine.config.kernels.isa if engine.config.kernels else ''} library, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, the CPU's own choice "
        f"{default} tile(s); decode at {CONTEXT} context; medians over {args.rounds} alternated rounds of "
        f"{args.repeats} steps; load {load:.1f} at the end"
    )
    one, many = sides
    print(f"| batch | {one} ms | {many} ms | {many} / {one} | same logits |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for batch in batches:
        a, b = statistics.median(times[one, batch]), statistics.median(times[many, batch])
        same = torch.equal(logits[one, batch], logits[many, batch])
        print(f"| {batch} | {a:.2f} | {b:.2f} | {b / a if a else math.nan:.3f} | {same} |")


if __name__ == "__main__":
    main()
