"""A window on some layers only: Qwen2/Qwen3/SmolLM3 `layer_types` (with `use_sliding_window`).

Pins: the spec slides exactly the layers `layer_types` calls sliding (ModelSpec.full_attention_layers
holds the others), as transformers' Qwen2/SmolLM3 attention does, and greedy output and last
logits equal transformers fp32 for prompts past the window (8), prefilled whole or in chunks
across its edges. Checked to fail with the window dropped and with it on every layer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checks import assert_last_logits_close, build_fp32
from greedy_loop import greedy_generate, hf_greedy
from step_cases import prompts
from tiny_models import tiny_config, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine

WINDOW = 8
# layer 1 slides: Qwen2's layers from max_window_layers on; SmolLM3's NoPE layer (no_rope_layers [1, 0])
WINDOWED = {
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "smollm3": dict(use_sliding_window=True, sliding_window=WINDOW),
}


def test_the_layers_layer_types_calls_sliding_take_the_window() -> None:
    """Only with use_sliding_window: transformers' attention ignores the window otherwise."""
    for architecture, overrides in (*WINDOWED.items(), ("qwen3", WINDOWED["qwen2"])):
        spec = model_spec_from_hf_config(tiny_config(architecture, 320, **overrides))
        assert (spec.sliding_window, spec.full_attention_layers) == (WINDOW, (0,)), architecture
        assert [spec.layer_window(0), spec.layer_window(1)] == [None, WINDOW]
    every = model_spec_from_hf_config(tiny_config("qwen2", 320, **{**WINDOWED["qwen2"], "max_window_layers": 0}))
    assert (every.sliding_window, every.full_attention_layers) == (WINDOW, ())
    unused = model_spec_from_hf_config(tiny_config("qwen2", 320, sliding_window=WINDOW, max_window_layers=1))
    assert (unused.sliding_window, unused.full_attention_layers) == (None, ())


@pytest.mark.parametrize("architecture", sorted(WINDOWED))
def test_a_window_on_some_layers_equals_transformers(architecture: str, tmp_path: Path) -> None:
    folder = write_hf_checkpoint(tmp_path / architecture, architecture, seed=5, **WINDOWED[architecture])
    engine = Engine.load(build_fp32(folder, tmp_path / "engine"), StepMode.COMPILED)
    assert engine.config.spec.full_attention_layers == (0,)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt in prompts(engine.config.spec.vocab_size, [5, 23, 40], seed=7):
        expected = hf_greedy(hf, prompt, 16)
        assert greedy_generate(engine, prompt, 16) == expected
        assert greedy_generate(engine, prompt, 16, chunk=WINDOW + 1) == expected
        assert_last_logits_close(engine, hf, prompt)
        assert_last_logits_close(engine, hf, prompt + expected)
