"""One step-time row per supported model family: a random model with the per-layer shape of the
family's smallest release (2 layers, a 32k vocabulary for all, so the rows compare the layers),
built with `--weights q8_0` (the block kernels, int8 compute where the CPU has integer dots),
against HF transformers eager on the same fp32 weights, in the same run.

    .venv/bin/python bench/families.py [--families llama,qwen3,...] [--repeats 5]

Prints ms per step for decode at batch 1 and 8 (256 tokens of context each) and one 512-token
prefill, and engine / transformers as a speedup per step. Writes bench/out/families.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import step  # engine_times / hf_times: the same measurement as bench/step.py
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import write_hf_checkpoint  # noqa: E402  (the tests' model writer: one place)

from ifb.builder.build import BuildOptions, build_engine  # noqa: E402
from ifb.runtime.step.backend import StepMode  # noqa: E402
from ifb.runtime.step.engine import Engine  # noqa: E402

COMMON = dict(num_hidden_layers=2, max_position_embeddings=4096)
VOCAB = 32000
# family -> (tests/tiny_models.py architecture, the release whose layer shape it takes, overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": (
        "llama",
        "Llama-3.2-1B",
        dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
    ),
    "qwen2": (
        "qwen2",
        "Qwen2.5-0.5B",
        dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2),
    ),
    "qwen3": (
        "qwen3",
        "Qwen3-0.6B",
        dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    ),
    "smollm3": (
        "smollm3",
        "SmolLM3-3B",
        dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=4),
    ),
    "phi3": (
        "phi3",
        "Phi-4-mini",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=24,
            num_key_value_heads=8,
            partial_rotary_factor=0.75,
        ),
    ),
    "mistral": (
        "mistral",
        "Mistral-7B-v0.1 (window 4096)",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            sliding_window=4096,
        ),
    ),
    "gemma3": (
        "gemma3_text",
        "Gemma-3-1B (window 512)",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            query_pre_attn_scalar=256,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma2": (
        "gemma2",
        "Gemma-2-2B (window 4096, caps 50/30)",
        dict(
            hidden_size=2304,
            intermediate_size=9216,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
}
LIMITS = dict(max_batch_size=8, max_num_tokens=512, max_seq_len=1024, block_size=16, kv_blocks=160)
STEPS = ("decode_b1", "decode_b8", "prefill_512")


def family_row(family: str, work: Path, repeats: int) -> dict[str, Any]:
    architecture, release, overrides = FAMILIES[family]
    folder = write_hf_checkpoint(work / family, architecture, vocab_size=VOCAB, **{**COMMON, **overrides})
    engine_dir = work / f"{family}-engine"
    build_engine(folder, engine_dir, BuildOptions(weights="q8_0", dtype="fp32", **LIMITS))
    engine = Engine.load(engine_dir, StepMode.COMPILED)
    ours = step.engine_times(engine, repeats)
    compute = engine.config.weight_compute.value
    del engine
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    theirs = step.hf_times(model, repeats)
    return {"release": release, "compute": compute, "ifb_ms": ours, "transformers_ms": theirs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=Path("bench/out/families.json"))
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    step.BATCHES = (1, 8)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ifb-families-") as scratch:
        for family in args.families.split(","):
            rows[family] = family_row(family, Path(scratch), args.repeats)
            print_row(family, rows[family])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(rows, indent=2))


def print_row(family: str, row: dict[str, Any]) -> None:
    cells = []
    for name in STEPS:
        ours, theirs = row["ifb_ms"][name], row["transformers_ms"][name]
        cells.append(f"{name} {ours:.1f} ms ({theirs / ours:.2f}x)")
    print(f"| {family} | {row['release']} | {row['compute']} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
