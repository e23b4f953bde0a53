"""Block-quantized matmul kernels vs torch fp32 F.linear, over one model step's linear layers.

    .venv/bin/python bench/quant_kernels.py [--model smollm2|llama1b] [--threads 2] [--repeats 5]
        [--bandwidth-gbs 36] [--isa avx2] [--rows 1 32] [--cpu-time]
    .venv/bin/python bench/quant_kernels.py --per-format [--threads 2]   # each int8 format alone

Runs every linear of one model step with distinct weights per layer, so weights stream from
memory as in a real step, and prints the ms of our exact kernel (fp32 activations), of the
`--compute int8` kernel (int8 activations, integer dots) and, for the small model, of F.linear on
the dequantized fp32 weights, measured in the same run, plus the weight-read floor (block bytes /
bandwidth) and the fraction of it the exact kernel reaches.

    smollm2  SmolLM2-135M: 30 layers of qkv, o, gate_up, down in Q4_1, the Q8_0 lm_head; M = 1, 8, 32, 512
    llama1b  Llama-3.2-1B as llama-quantize's Q4_K_M lays it out: 16 layers of q+k, o, gate_up in
             Q4_K, v and down in Q6_K on 8 layers (Q4_K on the rest), the tied 128256-row Q6_K
             head; random valid blocks (no F.linear: its fp32 weights would be 5 GB); M = 1, 32, 512
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
from ifb.plugins.quant_formats import WeightFormat, block_bytes, block_weights, dequantize, quantize

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down
LM_HEAD = (49152, 576)
ROWS = {"smollm2": (1, 8, 32, 512), "llama1b": (1, 32, 512)}


@dataclass(frozen=True, slots=True)
class Linear:
    """One weight in both forms: packed blocks for our kernel, dequantized fp32 for torch."""

    packed: torch.Tensor
    packed_int8: torch.Tensor
    dense: torch.Tensor | None
    fmt: WeightFormat
    n: int
    k: int


def make_linear(n: int, k: int, fmt: WeightFormat, seed: int) -> Linear:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    blocks = quantize(weight, fmt)
    packed, packed_int8 = quant_ops.pack(blocks, fmt, n, k), quant_ops.pack_int8(blocks, fmt, n, k)
    return Linear(packed, packed_int8, dequantize(blocks, fmt), fmt, n, k)


def random_linear(n: int, k: int, fmt: WeightFormat, seed: int) -> Linear:
    """Random valid GGUF blocks (any byte, small finite fp16 scales): the kernels' speed does not
    depend on the values, and K-quants have no quantizer here."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = n * k // block_weights(fmt)
    blocks = torch.randint(0, 256, (num_blocks, block_bytes(fmt)), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(num_blocks, 2, generator=generator) * 1e-3).to(torch.float16).view(torch.uint8)
    if fmt is WeightFormat.Q6_K:  # d is its last field
        blocks[:, -2:] = scales[:, :2]
    else:  # d, and m or dmin where the format has one (else two quant bytes: any value is valid)
        blocks[:, :4] = scales
    blocks = blocks.reshape(n, -1)
    return Linear(quant_ops.pack(blocks, fmt, n, k), quant_ops.pack_int8(blocks, fmt, n, k), None, fmt, n, k)


def smollm2_linears() -> list[Linear]:
    linears = [
        make_linear(n, k, WeightFormat.Q4_1, seed=layer * 8 + index)
        for layer in range(LAYERS)
        for index, (n, k) in enumerate(LAYER_SHAPES)
    ]
    return [*linears, make_linear(*LM_HEAD, WeightFormat.Q8_0, seed=-1)]


def llama1b_linears() -> list[Linear]:
    """Q4_K_M's layout of Llama-3.2-1B (llama.cpp gives attn_v/ffn_down more bits on some layers)."""
    layers, hidden, kv, inner = 16, 2048, 512, 8192
    more_bits = {i for i in range(layers) if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2}
    linears = []
    for layer in range(layers):
        wide = WeightFormat.Q6_K if layer in more_bits else WeightFormat.Q4_K
        shapes = [
            (hidden + kv, hidden, WeightFormat.Q4_K),  # q, k
            (kv, hidden, wide),  # v
            (hidden, hidden, WeightFormat.Q4_K),  # o
            (2 * inner, hidden, WeightFormat.Q4_K),  # gate, up
            (hidden, inner, wide),  # down
        ]
        linears += [random_linear(n, k, fmt, seed=layer * 8 + i) for i, (n, k, fmt) in enumerate(shapes)]
    return [*linears, random_linear(128256, hidden, WeightFormat.Q6_K, seed=-1)]


def block_bytes_read(linears: list[Linear]) -> int:
    return sum(lin.n * lin.k // block_weights(lin.fmt) * block_bytes(lin.fmt) for lin in linears)


def median_ms(fn: Callable[[], object], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def run_step(linears: list[Linear], inputs: dict[int, torch.Tensor], kernel: str) -> None:
    for lin in linears:
        x = inputs[lin.k]
        if kernel == "exact":
            quant_ops.quant_linear(x, lin.packed, lin.fmt, lin.n, lin.k)
        elif kernel == "int8":
            quant_ops.quant_linear_int8(x, lin.packed_int8, lin.fmt, lin.n, lin.k)
        elif lin.dense is not None:
            F.linear(x, lin.dense)


STREAM_CASES = (
    (WeightFormat.Q4_K, 8192, 2048),
    (WeightFormat.Q6_K, 2048, 8192),
    (WeightFormat.Q4_0, 8192, 2048),
    (WeightFormat.Q5_0, 2048, 8192),
    (WeightFormat.Q8_0, 2048, 8192),
)


def per_format(threads: int, repeats: int) -> None:
    """`--per-format`: each format's int8 kernel alone at M = 1, its matrices streamed from memory
    (six distinct ones of a 1B layer's shape in turn), against torch's sum over 512 MB (the read
    rate the same threads reach), and at M = 512 (G int8 ops/s, matrices in cache)."""
    buffer = torch.ones(128 << 20)
    read_gbs = buffer.numel() * 4 / (median_ms(buffer.sum, repeats) / 1e3) / 1e9
    print(f"threads {threads}: torch sum of 512 MB reads {read_gbs:.1f} GB/s")
    print(f"{'format':>7} {'n x k':>11} {'M=1 GB/s':>9} {'of read':>8} {'M=512 G ops/s':>14}")
    for fmt, n, k in STREAM_CASES:
        linears = [random_linear(n, k, fmt, seed=seed) for seed in range(6)]
        stream_ms = median_ms(partial(run_step, linears, {k: torch.randn(1, k)}, "int8"), repeats)
        gbs = block_bytes_read(linears) / (stream_ms / 1e3) / 1e9
        prefill_ms = median_ms(partial(run_step, linears[:1], {k: torch.randn(512, k)}, "int8"), max(2, repeats // 2))
        ops = 2 * 512 * n * k / (prefill_ms / 1e3) / 1e9
        print(f"{fmt.value:>7} {f'{n}x{k}':>11} {gbs:>9.1f} {gbs / read_gbs:>8.0%} {ops:>14.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(ROWS), default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bandwidth-gbs", type=float, default=36.0)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by process CPU time: with --threads 1 on a shared machine, what the kernel costs when it runs",
    )
    parser.add_argument("--rows", type=int, nargs="+", help="default: the model's M list")
    parser.add_argument(
        "--per-format",
        action="store_true",
        help="each format's int8 kernel alone: M=1 GB/s vs torch's read rate, M=512",
    )
    parser.add_argument("--isa", choices=[isa.value for isa in QuantIsa], help="default: the best this CPU runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        library = build_quant_library(Path(scratch), QuantIsa(args.isa) if args.isa else None)
        isa = load_quant_library(library.path, library.required_features)
    if args.per_format:
        print(f"ISA path {isa}")
        per_format(args.threads, args.repeats)
        return
    linears = smollm2_linears() if args.model == "smollm2" else llama1b_linears()
    has_dense = all(lin.dense is not None for lin in linears)
    formats = sorted({lin.fmt.value for lin in linears})
    floor_ms = block_bytes_read(linears) / (args.bandwidth_gbs * 1e9) * 1e3
    print(
        f"{args.model} ({', '.join(formats)}): ISA path {isa}; threads {args.threads}; block bytes per step: "
        f"{block_bytes_read(linears) / 1e6:.1f} MB"
    )
    print(f"weight-read floor at {args.bandwidth_gbs:.0f} GB/s: {floor_ms:.2f} ms")
    print(
        f"{'M':>5} {'exact ms':>9} {'int8 ms':>8} {'fp32 F.linear ms':>17} {'exact/int8':>10} {'F.linear/exact':>14} {'floor/exact':>11} {'floor/int8':>10}"
    )
    for rows in args.rows or ROWS[args.model]:
        inputs = {k: torch.randn(rows, k) for k in {lin.k for lin in linears}}
        repeats = (1 if not has_dense else max(2, args.repeats // 2)) if rows >= 512 else args.repeats
        clock = time.process_time if args.cpu_time else time.perf_counter
        ours = median_ms(partial(run_step, linears, inputs, "exact"), repeats, clock)
        int8 = median_ms(partial(run_step, linears, inputs, "int8"), repeats, clock)
        dense = median_ms(partial(run_step, linears, inputs, "dense"), repeats, clock) if has_dense else float("nan")
        print(
            f"{rows:>5} {ours:>9.2f} {int8:>8.2f} {dense:>17.2f} {ours / int8:>9.2f}x {dense / ours:>13.2f}x"
            f" {floor_ms / ours:>10.0%} {floor_ms / int8:>10.0%}"
        )


if __name__ == "__main__":
    main()
