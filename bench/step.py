"""Step-time benchmark: the compiled engine vs HF transformers eager, same weights, same run.

    .venv/bin/python bench/step.py [--engine ENGINE_DIR] [--repeats 7] [--no-hf]

Prints ms per step for decode at batch 1/8/32 (256 tokens of context each) and one 512-token
prefill, the machine's read bandwidth and the weight-read lower bound for a decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ifb.builder.build import BuildOptions
from ifb.builder.sources import load_model, resolve_source
from ifb.find_or_build import find_or_build_engine
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

CONTEXT = 256
BATCHES = (1, 8, 32)
PREFILL = 512


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
    parser.add_argument("--engine", default=None, help="engine folder (default: build/reuse the SmolLM2 engine)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, default=Path("bench/out/step.json"))
    parser.add_argument("--no-hf", action="store_true", help="engine only (e.g. a TensorRT engine in gpu-check)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

    folder = args.engine or find_or_build_engine(None, BuildOptions(max_batch_size=32, max_num_tokens=512))
    engine = Engine.load(folder, StepMode.COMPILED)
    weight_bytes = sum(p.stat().st_size for p in [engine.config.weights])
    bandwidth = read_bandwidth_gbs()
    label = f"ifb {engine.config.backend} ({engine.config.dtype})"
    results: dict[str, dict[str, float]] = {label: engine_times(engine, args.repeats)}
    del engine

    if not args.no_hf:
        results.update(hf_results(args.repeats))
    print_table(results, bandwidth, weight_bytes)
    ratios = speedups(results) if not args.no_hf else {}
    for name, ratio in ratios.items():
        print(f"speedup {name}: {ratio:.2f}x")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {"bandwidth_gbs": bandwidth, "weight_bytes": weight_bytes, "ms": results, "speedups": ratios}, indent=2
        )
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


def print_table(results: dict[str, dict[str, float]], bandwidth: float, weight_bytes: int) -> None:
    columns = [f"decode_b{b}" for b in BATCHES] + ["prefill_512"]
    print(
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"read bandwidth {bandwidth:.1f} GB/s; weights {weight_bytes / 1e6:.0f} MB -> decode lower bound {weight_bytes / bandwidth / 1e6:.1f} ms"
    )
    print(f"{'ms per step':40s}" + "".join(f"{c:>14s}" for c in columns))
    for name, row in results.items():
        print(f"{name:40s}" + "".join(f"{row[c]:14.1f}" for c in columns))


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
