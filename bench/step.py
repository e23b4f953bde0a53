"""Step-time benchmark: compiled engines vs HF transformers eager, same weights, same run.

    .venv/bin/python bench/step.py [--engine ENGINE_DIR ...] [--repeats 7] [--no-hf]
    .venv/bin/python bench/step.py --quant-vs-fp32 --no-hf      # SmolLM2: GGUF blocks vs fp32

Prints ms per step for decode at batch 1/8/32 (256 tokens of context each) and one 512-token
prefill, and for each engine step its weight-read floor: the bytes of weights that step reads
(every linear layer, packed blocks or floats, the norms, and the embedding rows it gathers)
at `--bandwidth-gbs`, and its compute floor: its multiply-adds at the rate this machine
reaches on cache-resident operands, measured in the same run (bench/compute_floor.py), with
the fraction of each floor the step reaches.

    .venv/bin/python bench/step.py --qwen3moe-layers 2 --no-hf   # a Qwen3-30B-A3B-shaped MoE engine

For a mixture-of-experts engine the weight-read floor counts only the experts a step's rows select
(the grouped op reads each once, the others not at all): the table's floors for it are those, and
a second table gives, per decode batch size (rows of distinct tokens), the distinct experts per
layer the router selected for those rows (read from the engine's eager network on the same
inputs) beside the uniform-routing expectation the step cost model prices, the bytes read, the
floor of those bytes, the step time and its ratio to the floor, and the engine's fitted cost
model's prediction.
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
from ifb.runtime.step.backend import NetworkStep, StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.moe_block import MoeBlock
from ifb.runtime.step.step_inputs import RequestSlice, StepInputs, build_step_inputs
from ifb.runtime.step_budget.cost_model import StepShape
from ifb.runtime.step_budget.expert_reads import ExpertRouting

CONTEXT = 256
BATCHES = (1, 8, 32)
PREFILL = 512
STEP_TOKENS = {**{f"decode_b{b}": b for b in BATCHES}, "prefill_512": PREFILL}
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1}
DEFAULT_BANDWIDTH_GBS = 36.0  # this machine's measured single-socket read bandwidth (perf-notes.md)


EXPERT_TENSORS = (".mlp.experts_gate_up", ".mlp.experts_down")


def expert_bytes(config: EngineConfig) -> dict[int, int]:
    """Layer index -> the bytes of one of its experts (gate/up and down, as stored)."""
    per_layer: dict[int, int] = {}
    with safe_open(str(config.weights_path), framework="pt") as weights:
        for name in weights.keys():
            if name.endswith(EXPERT_TENSORS):
                tensor = weights.get_slice(name)
                size = _DTYPE_BYTES[tensor.get_dtype()] * math.prod(tensor.get_shape())
                layer = int(name.split(".")[1])
                per_layer[layer] = per_layer.get(layer, 0) + size // config.spec.num_experts
    return per_layer


def weight_read_bytes(config: EngineConfig, num_tokens: int, experts: dict[int, float] | None = None) -> int:
    """Bytes of weights one step of `num_tokens` reads: all but the embedding table, of which it
    gathers `num_tokens` rows (the whole table when it is also the fp32 LM head; a block table
    tied to the head is the head's tiles, read whole by the head). An MoE step reads, of each
    layer's experts, the ones its rows select: `experts` (layer -> distinct experts; absent: the
    uniform-routing expectation for `num_tokens` rows)."""
    total = 0
    if config.spec.is_moe:
        routing = ExpertRouting(config.spec.num_experts, config.spec.num_experts_per_tok)
        per_expert = expert_bytes(config)
        selected = experts or {layer: routing.expected_distinct(num_tokens) for layer in per_expert}
        total += round(sum(selected[layer] * size for layer, size in per_expert.items()))
    vocab = config.spec.vocab_size
    with safe_open(str(config.weights_path), framework="pt") as weights:
        for name in weights.keys():
            tensor = weights.get_slice(name)
            shape = tensor.get_shape()
            tensor_bytes = _DTYPE_BYTES[tensor.get_dtype()] * math.prod(shape)
            head_is_embedding = config.spec.tie_word_embeddings and "lm_head" not in config.weight_formats
            if name in ("embed.weight", "embed.packed") and not head_is_embedding:
                total += min(vocab, num_tokens) * tensor_bytes // vocab  # the gathered rows only
            elif name != "rope.inv_freq" and not name.endswith(EXPERT_TENSORS):  # experts: above
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


def decode_inputs(engine: Engine, batch: int) -> StepInputs:
    """`batch` decode rows at CONTEXT, each on its own blocks, each its own token (so an MoE's rows
    route as different tokens do; a dense step's time does not depend on the ids)."""
    bs = engine.config.limits.block_size
    blocks = -(-(CONTEXT + 1) // bs)
    vocab = engine.config.spec.vocab_size
    slices = [
        RequestSlice([(5 + 7 * b) % vocab], CONTEXT, list(range(b * blocks, (b + 1) * blocks)), True)
        for b in range(batch)
    ]
    return build_step_inputs(slices, bs)


def engine_times(engine: Engine, repeats: int, batches: tuple[int, ...] = BATCHES) -> dict[str, float]:
    bs = engine.config.limits.block_size
    vocab = engine.config.spec.vocab_size
    blocks = -(-(CONTEXT + 1) // bs)
    out = {}
    for batch in batches:
        if batch * blocks > engine.config.limits.num_kv_blocks:  # rows on distinct blocks, as in serving
            print(
                f"decode_b{batch}: {batch} x {blocks} blocks exceed the engine's {engine.config.limits.num_kv_blocks}"
            )
            out[f"decode_b{batch}"] = math.nan
            continue
        inputs = decode_inputs(engine, batch)
        out[f"decode_b{batch}"] = median_ms(lambda inputs=inputs: engine.step(inputs), repeats)
    prefill = build_step_inputs(
        [RequestSlice([(100 + i) % vocab for i in range(PREFILL)], 0, list(range(PREFILL // bs)), True)], bs
    )
    out["prefill_512"] = median_ms(lambda: engine.step(prefill), max(3, repeats // 2))
    return out


MOE_BATCHES = (1, 2, 4, 8, 16, 32)


def selected_experts(eager: Engine, inputs: StepInputs) -> dict[int, int]:
    """Layer -> the distinct experts its router selects for the step's rows: the top-k of each
    MoeBlock's router logits (the order of its softmax), taken from the eager network's own step."""
    found: dict[int, int] = {}
    hooks = []
    assert isinstance(eager.backend, NetworkStep)
    for index, layer in enumerate(eager.backend.network.layers):
        if isinstance(layer.mlp, MoeBlock):

            def hook(module: object, args: object, logits: torch.Tensor, index: int = index, k: int = layer.mlp.top_k):
                found[index] = int(torch.topk(logits.float(), k, dim=-1).indices.unique().numel())

            hooks.append(layer.mlp.router.register_forward_hook(hook))
    try:
        eager.step(inputs)
    finally:
        for handle in hooks:
            handle.remove()
    return found


def moe_rows(folder: Path, repeats: int, floor_gbs: float) -> list[dict[str, float]]:
    """Per decode batch size: the experts its rows select, the bytes that makes, the floor of those
    bytes, the compiled step's time and the engine's cost model's prediction."""
    compiled = Engine.load(folder, StepMode.COMPILED)
    config = compiled.config
    times = engine_times(compiled, repeats, MOE_BATCHES)
    del compiled
    eager = Engine.load(folder, StepMode.EAGER)
    routing = ExpertRouting(config.spec.num_experts, config.spec.num_experts_per_tok)
    rows = []
    for batch in MOE_BATCHES:
        ms = times[f"decode_b{batch}"]
        if math.isnan(ms):
            continue
        distinct = selected_experts(eager, decode_inputs(eager, batch))
        read = weight_read_bytes(config, batch, {layer: float(n) for layer, n in distinct.items()})
        shape = StepShape(num_decode_rows=batch, num_decode_context_tokens=batch * (CONTEXT + 1))
        rows.append(
            {
                "batch": batch,
                "distinct_experts_per_layer": statistics.mean(distinct.values()),
                "uniform_expectation": routing.expected_distinct(batch),
                "mb_read": read / 1e6,
                "floor_ms": read / (floor_gbs * 1e9) * 1000,
                "ms": ms,
                "predicted_ms": math.nan if config.cost_model is None else config.cost_model.predict_ms(shape),
            }
        )
    return rows


def print_moe_rows(label: str, config: EngineConfig, rows: list[dict[str, float]], floor_gbs: float) -> None:
    spec = config.spec
    print(
        f"{label}: {spec.num_layers} layers x {spec.num_experts} experts, {spec.num_experts_per_tok} per token; "
        f"decode at {CONTEXT} context, rows of distinct tokens; floor at {floor_gbs:.0f} GB/s"
    )
    print(
        f"{'batch':>6s}{'experts/layer':>15s}{'uniform E[.]':>14s}{'MB read':>10s}{'floor ms':>10s}"
        f"{'step ms':>10s}{'step/floor':>12s}{'model ms':>10s}"
    )
    for row in rows:
        print(
            f"{row['batch']:6d}{row['distinct_experts_per_layer']:15.1f}{row['uniform_expectation']:14.1f}"
            f"{row['mb_read']:10.1f}{row['floor_ms']:10.2f}{row['ms']:10.2f}{row['ms'] / row['floor_ms']:12.2f}"
            f"{row['predicted_ms']:10.2f}"
        )


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
    parser.add_argument(
        "--qwen3moe-layers",
        type=int,
        default=0,
        help="build/reuse a random-weight Qwen3-30B-A3B-shaped MoE engine of this many layers (bench/out)",
    )
    parser.add_argument("--moe-weights", default="q8_0", help="--weights for that engine (q8_0, q4_0, q4_1)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))

    bandwidth = read_bandwidth_gbs()
    results: dict[str, dict[str, float]] = {}
    floors: dict[str, dict[str, float]] = {}
    configs: dict[str, EngineConfig] = {}
    moe: dict[str, tuple[Path, EngineConfig]] = {}
    for folder in engine_folders(args):
        engine = Engine.load(folder, StepMode.COMPILED)
        label = engine_label(engine.config)
        configs[label] = engine.config
        if engine.config.spec.is_moe:
            moe[label] = (folder, engine.config)
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
    moe_results = {}
    for label, (folder, config) in moe.items():
        moe_results[label] = moe_rows(folder, args.repeats, args.bandwidth_gbs)
        print_moe_rows(label, config, moe_results[label], args.bandwidth_gbs)
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
                "moe_expert_reads": moe_results,
            },
            indent=2,
        )
    )


# Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, 8 per token,
# norm_topk_prob); a 512-token vocabulary, so the steps' bytes are the layers' (the real model's
# 151k-row head is another ~0.3 GB a token at Q8_0).
QWEN3_30B_A3B_LAYER = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
)


def qwen3moe_folder(layers: int) -> Path:
    """A random-weight (transformers' own init, bf16) Qwen3-30B-A3B-shaped HF folder of `layers`
    decoder layers under bench/out (made once)."""
    import sys

    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    folder = Path(f"bench/out/qwen3moe-30b-a3b-shaped-{layers}l")
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from sharp_models import VOCAB_SIZE, write_spm_tokenizer

    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **QWEN3_30B_A3B_LAYER,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    write_spm_tokenizer(folder)
    return folder


def engine_folders(args: argparse.Namespace) -> list[Path]:
    if args.engine:
        return [Path(folder) for folder in args.engine]
    if args.qwen3moe_layers:
        options = BuildOptions(weights=args.moe_weights, max_batch_size=32, max_num_tokens=512)
        return [find_or_build_engine(qwen3moe_folder(args.qwen3moe_layers), options)]
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
