"""Block-quantized matmul kernels vs torch fp32 F.linear, over SmolLM2-135M's linear layers.

    .venv/bin/python bench/quant_kernels.py [--threads 2] [--repeats 5] [--bandwidth-gbs 36] [--isa avx2]

For M = 1, 8, 32 and 512 rows, runs every linear of one model step (30 layers of qkv, o,
gate_up, down in Q4_1, then the Q8_0 lm_head) with distinct weights per layer, so weights
stream from memory as in a real step, and prints the ms of our exact kernel (fp32 activations),
of the `--compute int8` kernel (int8 activations, integer dots) and of F.linear on the
dequantized fp32 weights, measured in the same run, plus the weight-read floor
(block bytes / bandwidth) and the fraction of it the exact kernel reaches.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import QuantIsa, build_quant_library, load_quant_library
from ifb.plugins.quant_formats import WeightFormat, block_bytes, dequantize, quantize

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down
LM_HEAD = (49152, 576)
ROWS = (1, 8, 32, 512)


@dataclass(frozen=True, slots=True)
class Linear:
    """One weight in both forms: packed blocks for our kernel, dequantized fp32 for torch."""

    packed: torch.Tensor
    packed_int8: torch.Tensor
    dense: torch.Tensor
    fmt: WeightFormat

    @property
    def n(self) -> int:
        return self.dense.shape[0]

    @property
    def k(self) -> int:
        return self.dense.shape[1]


def make_linear(n: int, k: int, fmt: WeightFormat, seed: int) -> Linear:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    blocks = quantize(weight, fmt)
    return Linear(
        quant_ops.pack(blocks, fmt, n, k), quant_ops.pack_int8(blocks, fmt, n, k), dequantize(blocks, fmt), fmt
    )


def model_linears() -> list[Linear]:
    linears = [
        make_linear(n, k, WeightFormat.Q4_1, seed=layer * 8 + index)
        for layer in range(LAYERS)
        for index, (n, k) in enumerate(LAYER_SHAPES)
    ]
    return [*linears, make_linear(*LM_HEAD, WeightFormat.Q8_0, seed=-1)]


def block_bytes_read(linears: list[Linear]) -> int:
    return sum(lin.n * lin.k // 32 * block_bytes(lin.fmt) for lin in linears)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_step(linears: list[Linear], inputs: dict[int, torch.Tensor], kernel: str) -> None:
    for lin in linears:
        x = inputs[lin.k]
        if kernel == "exact":
            quant_ops.quant_linear(x, lin.packed, lin.fmt, lin.n, lin.k)
        elif kernel == "int8":
            quant_ops.quant_linear_int8(x, lin.packed_int8, lin.fmt, lin.n, lin.k)
        else:
            F.linear(x, lin.dense)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth-gbs", type=float, default=36.0)
    parser.add_argument("--isa", choices=[isa.value for isa in QuantIsa], help="default: the best this CPU runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        library = build_quant_library(Path(scratch), QuantIsa(args.isa) if args.isa else None)
        isa = load_quant_library(library.path, library.required_features)
    linears = model_linears()
    floor_ms = block_bytes_read(linears) / (args.bandwidth_gbs * 1e9) * 1e3
    print(f"ISA path: {isa}; threads: {args.threads}; block bytes per step: {block_bytes_read(linears) / 1e6:.1f} MB")
    print(f"weight-read floor at {args.bandwidth_gbs:.0f} GB/s: {floor_ms:.2f} ms")
    print(
        f"{'M':>5} {'exact ms':>9} {'int8 ms':>8} {'fp32 F.linear ms':>17} {'exact/int8':>10} {'F.linear/exact':>14} {'floor/exact':>11}"
    )
    for rows in ROWS:
        inputs = {k: torch.randn(rows, k) for k in {lin.k for lin in linears}}
        repeats = max(2, args.repeats // 2) if rows >= 512 else args.repeats
        ours = median_ms(partial(run_step, linears, inputs, "exact"), repeats)
        int8 = median_ms(partial(run_step, linears, inputs, "int8"), repeats)
        dense = median_ms(partial(run_step, linears, inputs, "dense"), repeats)
        print(
            f"{rows:>5} {ours:>9.2f} {int8:>8.2f} {dense:>17.2f} {ours / int8:>9.2f}x {dense / ours:>13.2f}x"
            f" {floor_ms / ours:>10.0%}"
        )


if __name__ == "__main__":
    main()
