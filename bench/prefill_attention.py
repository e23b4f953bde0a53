"""Prefill attention: a chunk over a cached context vs a fresh prompt, row-at-a-time vs tiled.

    .venv/bin/python bench/prefill_attention.py [--shape 1b|smollm2] [--kv-dtype fp32|fp16|bf16|q8_0]
        [--chunk 448] [--cached 1536] [--repeats 5] [--layer-step]

It times `ifb_quant::paged_attention` over one layer's prefill rows, as the engine calls it
(every query row of a request with the request's block table, seq_len = its position + 1): a
fresh `--chunk`-token prompt, and a `--chunk`-token chunk after `--cached` cached tokens. Each
case runs twice, alternated in one process: "rows" gives each row a block table that differs from
its neighbour's in one unread trailing entry, so the kernel cannot tile them and reads every
row's keys alone (the decode kernel, as before tiling); "tiled" passes the shared table, so
rows of the request share K/V loads. The machine is shared: ratios within one run, not absolute
times, are what to read, and the load average is printed beside them.

With --layer-step it also times the shape's layer matmuls at `--chunk` rows (the engine's int8
block kernel on random valid blocks: Llama-3.2-1B's Q4_K/Q6_K, SmolLM2's Q4_1) alternated with
the attention calls, and prints layers x (matmuls + attention) for a fresh prompt and for the
chunk over the cache: the step's two big parts, not a compiled engine step (norms, RoPE, the
LM head and the step's Python are left out, which makes the printed ratio an upper bound).

With --peaks (implies --layer-step) it measures this machine's int8 dot and fp32 FMA peaks
(bench/int8_peak.py's loops), prints the multiply-adds each part does and the fraction of its peak
it reached, and the least cached / fresh ratio fp32 attention allows: attention at the fp32 FMA
peak beside the matmuls as measured, and beside matmuls at 75% of the int8 peak (#38's target).
A chunk over a long cache does (cached + chunk / 2) / (chunk / 2) times a fresh prompt's
attention work; no fp32 kernel can make that cheaper than the peak.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ifb.plugins.kv_format import quantize_q8_0
from ifb.plugins.quant_build import build_quant_library, load_quant_library

BLOCK = 16
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = {"1b": Shape(32, 8, 64), "smollm2": Shape(9, 3, 64)}
LAYERS = {"1b": 16, "smollm2": 30}
MATMUL_SHAPES = {"1b": "llama1b", "smollm2": "smollm2"}  # bench/kernel_ab.py's MATMULS
KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def alternated_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each fn, the fns run in turn within every repeat (so load drifts hit all)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def pools(shape: Shape, slots: int, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = torch.randn(slots, shape.kv_heads, shape.head_dim), torch.randn(slots, shape.kv_heads, shape.head_dim)
    if kv_dtype == "q8_0":
        return quantize_q8_0(k), quantize_q8_0(v)
    return k.to(KV_DTYPES[kv_dtype]), v.to(KV_DTYPES[kv_dtype])


def prefill_call(
    shape: Shape, k_pool: torch.Tensor, v_pool: torch.Tensor, chunk: int, cached: int, tiled: bool
) -> Callable[[], torch.Tensor]:
    """One layer's attention for `chunk` rows of one request at positions cached..cached+chunk-1."""
    blocks = -(-(cached + chunk) // BLOCK)
    table = torch.arange(blocks) * 2  # every other block: scattered over the pool
    tables = table[None].expand(chunk, -1)
    if not tiled:  # an unread trailing entry that alternates: no two neighbours share a table
        tables = torch.cat([tables, (torch.arange(chunk) % 2)[:, None]], dim=1)
    tables = tables.contiguous()
    lengths = torch.arange(cached + 1, cached + chunk + 1)
    q = torch.randn(chunk, shape.heads, shape.head_dim)
    return lambda: torch.ops.ifb_quant.paged_attention(q, k_pool, v_pool, tables, lengths, BLOCK, 0.125, "", None)


def attention_calls(shape: Shape, kv_dtype: str, chunk: int, cached: int) -> dict[str, Callable[[], torch.Tensor]]:
    slots = 2 * BLOCK * (-(-(cached + chunk) // BLOCK) + 1)
    k_pool, v_pool = pools(shape, slots, kv_dtype)
    return {
        f"{mode} {label}": prefill_call(shape, k_pool, v_pool, chunk, context, mode == "tiled")
        for mode in ("rows", "tiled")
        for label, context in (("fresh", 0), ("cached", cached))
    }


def layer_matmuls(shape_name: str, rows: int) -> Callable[[], None]:
    """One layer's matmuls (qkv, o, gate/up, down) at `rows` rows, the engine's int8 kernel."""
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "unit")]
    from kernel_ab import MATMULS
    from quant_cases import random_blocks, random_x

    from ifb.plugins import quant_ops
    from ifb.plugins.quant_formats import WeightFormat

    weights = []
    for n, k, type_name in MATMULS[MATMUL_SHAPES[shape_name]]:
        fmt = WeightFormat[type_name]
        weights.append(
            (random_x(rows, k, seed=k), quant_ops.pack_int8(random_blocks(n, k, fmt, seed=n + k), fmt, n, k), fmt, n, k)
        )

    def run() -> None:
        for x, packed, fmt, n, k in weights:
            quant_ops.quant_linear_int8(x, packed, fmt, n, k)

    return run


def attention_macs(shape: Shape, chunk: int, cached: int) -> int:
    """One layer's multiply-adds for `chunk` rows after `cached` tokens: each row's q.k and p.v
    over its seq_len = position + 1 keys, every query head."""
    keys = chunk * cached + chunk * (chunk + 1) // 2
    return 2 * shape.heads * shape.head_dim * keys


def matmul_macs(shape_name: str, rows: int) -> int:
    sys.path[:0] = [str(ROOT / "bench")]
    from kernel_ab import MATMULS

    return rows * sum(n * k for n, k, _ in MATMULS[MATMUL_SHAPES[shape_name]])


def report_peaks(shape_name: str, chunk: int, cached: int, ms: dict[str, float], matmul_ms: float) -> None:
    """Each part's rate against its loop's peak, and the least cached / fresh ratio fp32 attention allows."""
    sys.path[:0] = [str(ROOT / "bench")]
    from int8_peak import measure_fp32_peak, measure_int8_peak

    int8, fp32 = measure_int8_peak(), measure_fp32_peak()
    print(
        f"peaks: int8 {int8.macs_per_s / 1e9:.0f} G/s ({int8.instruction}), fp32 {fp32.macs_per_s / 1e9:.0f} G/s "
        f"({fp32.instruction}), {fp32.threads} threads"
    )
    shape = SHAPES[shape_name]
    matmul = matmul_macs(shape_name, chunk)
    print(
        f"  layer matmuls: {matmul / 1e9:.2f} G multiply-adds, {matmul / (matmul_ms / 1e3) / int8.macs_per_s:.0%} of int8"
    )
    floor_ms = {}
    for label, context in (("fresh", 0), ("cached", cached)):
        macs = attention_macs(shape, chunk, context)
        floor_ms[label] = macs / fp32.macs_per_s * 1e3
        print(
            f"  attention {label}: {macs / 1e9:.2f} G multiply-adds, tiled at "
            f"{floor_ms[label] / ms[f'tiled {label}']:.0%} of fp32 (floor {floor_ms[label]:.2f} ms)"
        )
    target_ms = matmul / (0.75 * int8.macs_per_s) * 1e3
    for what, base in (("as measured", matmul_ms), ("at 75% of int8", target_ms)):
        bound = (base + floor_ms["cached"]) / (base + floor_ms["fresh"])
        print(f"  least cached / fresh with attention at the fp32 peak, matmuls {what}: {bound:.2f}x")


def report(title: str, ms: dict[str, float]) -> None:
    print(f"{title}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}:")
    for name, value in ms.items():
        print(f"  {name:14s} {value:8.2f} ms")
    for mode in ("rows", "tiled"):
        print(f"  {mode}: cached / fresh = {ms[f'{mode} cached'] / ms[f'{mode} fresh']:.2f}x")
    for label in ("fresh", "cached"):
        print(f"  {label}: rows / tiled = {ms[f'rows {label}'] / ms[f'tiled {label}']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--kv-dtype", choices=[*KV_DTYPES, "q8_0"], default="fp32")
    parser.add_argument("--chunk", type=int, default=448)
    parser.add_argument("--cached", type=int, default=1536)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layer-step", action="store_true")
    parser.add_argument("--peaks", action="store_true", help="each part against its loop's peak (implies --layer-step)")
    args = parser.parse_args()
    args.layer_step = args.layer_step or args.peaks
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        library = build_quant_library(Path(scratch))
        load_quant_library(library.path, library.required_features)
    shape = SHAPES[args.shape]
    calls = attention_calls(shape, args.kv_dtype, args.chunk, args.cached)
    if args.layer_step:
        calls["matmuls"] = layer_matmuls(args.shape, args.chunk)
    ms = alternated_ms(calls, args.repeats)
    matmul_ms = ms.pop("matmuls", None)
    report(f"attention, one layer, {shape} {args.kv_dtype}, {args.chunk} rows fresh / over {args.cached} cached", ms)
    if matmul_ms is not None:
        layers = LAYERS[args.shape]
        print(f"layer matmuls at {args.chunk} rows: {matmul_ms:.2f} ms")
        step = {name: layers * (matmul_ms + value) for name, value in ms.items()}
        report(f"{layers} layers x (matmuls + attention)", step)
        if args.peaks:
            report_peaks(args.shape, args.chunk, args.cached, ms, matmul_ms)


if __name__ == "__main__":
    main()
