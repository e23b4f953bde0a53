"""Decode attention: the paged kernel alone, and a compiled step's time as its context grows.

    .venv/bin/python bench/decode_attention.py [--engine engines/smollm2-b32-t512-q4_1-int8] [--rows 32]

Part 1 times `ifb_quant::paged_decode_attention` over SmolLM2's shapes (30 layers, 9 query and 3
KV heads of 64, fp32 pools, each request's blocks scattered) and prints the K/V bytes it read
per second. Part 2 (with --engine) times one decode step of `--rows` requests at 15, 64, 256 and
1024 tokens of context: the growth with context is what attention costs in the step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ifb.plugins.quant_build import build_quant_library, load_quant_library
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CONTEXTS = (15, 64, 256, 1024)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_alone(rows: int, context: int, repeats: int) -> None:
    blocks = -(-(context + 1) // BLOCK)
    slots = rows * blocks * 3 * BLOCK
    k_pool, v_pool = torch.randn(slots, KV_HEADS, HEAD_DIM), torch.randn(slots, KV_HEADS, HEAD_DIM)
    q = torch.randn(rows, HEADS, HEAD_DIM)
    tables = torch.arange(rows * blocks).reshape(rows, blocks) * 3  # every third block: scattered
    lengths = torch.full((rows,), context + 1)

    def step() -> None:
        for _ in range(LAYERS):
            torch.ops.ifb_quant.paged_decode_attention(q, k_pool, v_pool, tables, lengths, BLOCK, 0.125)

    ms = median_ms(step, repeats)
    kv_bytes = 2 * LAYERS * rows * (context + 1) * KV_HEADS * HEAD_DIM * 4
    print(
        f"kernel alone, {rows} rows x {context + 1} keys x {LAYERS} layers: {ms:.1f} ms, {kv_bytes / ms / 1e6:.1f} GB/s"
    )


def step_by_context(engine_dir: Path, rows: int, repeats: int) -> None:
    engine = Engine.load(engine_dir, StepMode.COMPILED)
    block_size = engine.config.limits.block_size
    for context in CONTEXTS:
        blocks = -(-(context + 1) // block_size)
        slices = [RequestSlice([5], context, list(range(r * blocks, (r + 1) * blocks)), True) for r in range(rows)]
        inputs = build_step_inputs(slices, block_size)
        ms = median_ms(lambda inputs=inputs: engine.step(inputs), repeats)
        print(f"{engine_dir.name}: decode step, {rows} rows at {context} tokens: {ms:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", type=Path, default=None)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.engine is not None:  # loads the engine's own kernel library
        step_by_context(args.engine, args.rows, args.repeats)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            library = build_quant_library(Path(scratch))
            load_quant_library(library.path, library.required_features)
    kernel_alone(args.rows, 256, args.repeats)


if __name__ == "__main__":
    main()
