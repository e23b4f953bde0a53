"""Step-time benchmark: compiled engines vs HF transformers eager, same weights, same run.

    .venv/bin/python bench/step.py [--engine ENGINE_DIR ...] [--repeats 7] [--no-hf]
    .venv/bin/python bench/step.py --quant-vs-fp32 --no-hf      # SmolLM2: GGUF blocks vs fp32

Prints ms per step for decode at batch 1/8/32 (256 tokens of context each) and one 512-token
prefill, and for each engine step its weight-read floor: the bytes of weights that step reads
(every linear layer, packed blocks or floats, the norms, and the embedding rows it gathers)
at `--bandwidth-gbs`, and its compute floor: its multiply-adds at the rate this machine
reaches on cache-resident operands, measured in the same run (bench/compute_floor.py), with
the fraction of each floor the step reaches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from compute_floor import PeakRates, compute_floor_ms, measure_peak_rates, step_work
from safetensors import safe_open

from ifb.builder.build import BuildOptions
from ifb.builder.sources import load_model, resolve_source
from ifb.find_or_build import find_or_build_engine
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

CONTEXT = 256
BATCHES = (1, 8, 32)
PREFILL = 512
STEP_TOKENS = {**{f"decode_b{b}": b for b in BATCHES}, "prefill_512": PREFILL}
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1}
DEFAULT_BANDWIDTH_GBS = 36.0  # this machine's measured single-socket read bandwidth (perf-notes.md)


def weight_read_bytes(config: EngineConfig, num_tokens: int) -> int:
    """Bytes of weights one step of `num_tokens` reads: all but the embedding table, of which it
    gathers `num_tokens` rows (the whole table when it is also the fp32 LM head; a block table
    tied to the head is the head's tiles, read whole by the head)."""
    total = 0
    vocab = config.spec.vocab_size
    with safe_open(str(config.weights_path), framework="pt") as weights:
        for name in weights.keys():
            tensor = weights.get_slice(name)
            shape = tensor.get_shape()
            tensor_bytes = _DTYPE_BYTES[tensor.get_dtype()] * math.prod(shape)
            head_is_embedding = config.spec.tie_word_embeddings and "lm_head" not in config.weight_formats
            if name in ("embed.weight", "embed.packed") and not head_is_embedding:
                total += min(vocab, num_tokens) * tensor_bytes // vocab  # the gathered rows only
            elif name != "rope.inv_freq":
                total += tensor_bytes
    return total


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def read_bandwidth_gbs() -> float:
    buffer = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    ms = median_ms(lambda: buffer.sum(), 5)
    return buffer.numel() * 4 / (ms / 1000) / 1e9


def engine_times(engine: Engine, repeats: int) -> dict[str, float]:
    bs = engine.config.limits.block_size
    blocks = -(-(CONTEXT + 1) // bs)
    out = {}
    for batch in BATCHES:
        if batch * blocks > engine.config.limits.num_kv_blocks:  # rows on distinct blocks, as in serving
            print(
                f"decode_b{batch}: {batch} x {blocks} blocks exceed the engine's {engine.config.limits.num_kv_blocks}"
            )
            out[f"decode_b{batch}"] = math.nan
            continue
        slices = [RequestSlice([5], CONTEXT, list(range(b * blocks, (b + 1) * blocks)), True) for b in range(batch)]
        inputs = build_step_inputs(slices, bs)
        out[f"decode_b{batch}"] = median_ms(lambda inputs=inputs: engine.step(inputs), repeats)
    prefill = build_step_inputs(
        [RequestSlice(list(range(100, 100 + PREFILL)), 0, list(range(PREFILL // bs)), True)], bs
    )
    out["prefill_512"] = median_ms(lambda: engine.step(prefill), max(3, repeats // 2))
    return out


def hf_times(model: torch.nn.Module, repeats: int) -> dict[str, float]:
    from transformers import DynamicCache

    out = {}
    with torch.inference_mode():
        for batch in BATCHES:
            cache = DynamicCache()
            model(torch.full((batch, CONTEXT), 7), past_key_values=cache, use_cache=True)
            step_ids = torch.full((batch, 1), 5)

            def step(cache: DynamicCache = cache, step_ids: torch.Tensor = step_ids) -> None:
                model(step_ids, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # drop the token just added: every call decodes at 256

            out[f"decode_b{batch}"] = median_ms(step, repeats)
        prompt = torch.arange(100, 100 + PREFILL)[None]
        out["prefill_512"] = median_ms(lambda: model(prompt, use_cache=False, logits_to_keep=1), max(3, repeats // 2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--engine", action="append", default=None, help="engine folder, repeatable (default: build/reuse SmolLM2's)"
    )
    parser.add_argument(
        "--quant-vs-fp32",
        action="store_true",
        help="build/reuse the default SmolLM2 engine twice: --weights auto (its GGUF blocks) and --weights fp32",
    )
    parser.add_argument("--bandwidth-gbs", type=float, default=DEFAULT_BANDWIDTH_GBS, help="for the weight-read floor")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, default=Path("bench/out/step.json"))
    parser.add_argument("--no-hf", action="store_true", help="engine only (e.g. a TensorRT engine in gpu-check)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

    bandwidth = read_bandwidth_gbs()
    results: dict[str, dict[str, float]] = {}
    floors: dict[str, dict[str, float]] = {}
    configs: dict[str, EngineConfig] = {}
    for folder in engine_folders(args):
        engine = Engine.load(folder, StepMode.COMPILED)
        label = engine_label(engine.config)
        configs[label] = engine.config
        results[label] = engine_times(engine, args.repeats)
        floors[label] = {
            step: weight_read_bytes(engine.config, tokens) / (args.bandwidth_gbs * 1e9) * 1000
            for step, tokens in STEP_TOKENS.items()
        }
        del engine
    rates = measure_peak_rates()  # after the engines: the int8 rate needs their kernel library
    compute_floors = {label: step_compute_floors(config, rates) for label, config in configs.items()}
    if not args.no_hf:
        results.update(hf_results(args.repeats))
    print_table(results, bandwidth, floors, args.bandwidth_gbs)
    print_compute_floors(results, compute_floors, rates)
    ratios = speedups(results) if not args.no_hf else {}
    for name, ratio in ratios.items():
        print(f"speedup {name}: {ratio:.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "measured_bandwidth_gbs": bandwidth,
                "floor_bandwidth_gbs": args.bandwidth_gbs,
                "ms": results,
                "weight_read_floor_ms": floors,
                "compute_floor_ms": compute_floors,
                "peak_multiply_adds_per_s": {"fp32": rates.fp32, "int8": rates.int8},
                "speedups": ratios,
            },
            indent=2,
        )
    )


def engine_folders(args: argparse.Namespace) -> list[Path]:
    if args.engine:
        return [Path(folder) for folder in args.engine]
    limits = {"max_batch_size": 32, "max_num_tokens": 512}
    if args.quant_vs_fp32:
        return [
            find_or_build_engine(None, BuildOptions(weights="auto", **limits)),
            find_or_build_engine(None, BuildOptions(weights="fp32", dtype="float32", **limits)),
        ]
    return [find_or_build_engine(None, BuildOptions(**limits))]


def engine_label(config: EngineConfig) -> str:
    formats = sorted(set(config.weight_formats.values())) or ["dense"]
    kv = "" if config.kv_dtype == config.dtype else f", KV {config.kv_dtype}"
    compute = "" if config.weight_compute == "fp32" else f", {config.weight_compute.value} compute"
    return f"ifb {config.backend.value} {'+'.join(formats)} ({config.dtype}{kv}{compute})"


def step_compute_floors(config: EngineConfig, rates: PeakRates) -> dict[str, float]:
    int8 = config.weight_compute == "int8"
    floors = {f"decode_b{b}": compute_floor_ms(step_work(config, b, b, CONTEXT + 1), rates, int8) for b in BATCHES}
    floors["prefill_512"] = compute_floor_ms(step_work(config, PREFILL, 1, (PREFILL + 1) / 2), rates, int8)
    return floors


def print_compute_floors(
    results: dict[str, dict[str, float]], floors: dict[str, dict[str, float]], rates: PeakRates
) -> None:
    int8 = "not measured" if rates.int8 is None else f"{rates.int8 / 1e9:.0f} G int8 multiply-adds/s"
    print(f"compute floors at {rates.fp32 / 1e9:.0f} G fp32 multiply-adds/s (torch GEMM, in cache), {int8}")
    columns = [f"decode_b{b}" for b in BATCHES] + ["prefill_512"]
    for name, floor in floors.items():
        print(f"{name:40s}" + "".join(f"{floor[c]:14.1f}" for c in columns))
        print(
            f"{'  fraction of compute floor reached':40s}"
            + "".join(f"{floor[c] / results[name][c]:14.2f}" for c in columns)
        )


def hf_results(repeats: int) -> dict[str, dict[str, float]]:
    from transformers import AutoModelForCausalLM

    loaded = load_model(resolve_source(None))
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_config(loaded.hf_config, dtype=dtype)
        model.load_state_dict(loaded.state_dict, strict=False)
        model.tie_weights()
        results[f"HF transformers eager ({str(dtype).split('.')[-1]})"] = hf_times(model.eval(), repeats)
        del model
    return results


def print_table(
    results: dict[str, dict[str, float]], bandwidth: float, floors: dict[str, dict[str, float]], floor_gbs: float
) -> None:
    columns = [f"decode_b{b}" for b in BATCHES] + ["prefill_512"]
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"measured read bandwidth {bandwidth:.1f} GB/s; weight-read floors at {floor_gbs:.0f} GB/s")
    print(f"{'ms per step':40s}" + "".join(f"{c:>14s}" for c in columns))
    for name, row in results.items():
        print(f"{name:40s}" + "".join(f"{row[c]:14.1f}" for c in columns))
        if name in floors:
            print(f"{'  weight-read floor ms':40s}" + "".join(f"{floors[name][c]:14.1f}" for c in columns))
            print(
                f"{'  fraction of floor reached':40s}" + "".join(f"{floors[name][c] / row[c]:14.2f}" for c in columns)
            )


def speedups(results: dict[str, dict[str, float]]) -> dict[str, float]:
    ours = next(iter(results.values()))
    hf32 = results["HF transformers eager (float32)"]
    hf16 = results["HF transformers eager (bfloat16)"]
    return {
        "decode_b32 vs HF bf16": hf16["decode_b32"] / ours["decode_b32"],
        "decode_b1 vs faster HF": min(hf32["decode_b1"], hf16["decode_b1"]) / ours["decode_b1"],
        "prefill_512 vs HF bf16": hf16["prefill_512"] / ours["prefill_512"],
        "prefill_512 vs HF fp32": hf32["prefill_512"] / ours["prefill_512"],
    }


if __name__ == "__main__":
    main()
