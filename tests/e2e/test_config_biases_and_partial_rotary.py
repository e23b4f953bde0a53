"""What a config declares that the builder once dropped, checked against transformers on the HF folder.

- `attention_bias: true` gives Llama's o_proj a bias beside q/k/v's, and `mlp_bias: true` gives
  gate/up/down one: an engine from the HF folder, and one from the GGUF llama.cpp's own converter
  writes of it (`attn_output.bias`, `ffn_*.bias`), both equal transformers' LlamaForCausalLM.
- Phi-3 with `partial_rotary_factor` 0.75 and plain RoPE rotates 12 of each head's 16 dims, as
  Phi3RotaryEmbedding does (the builder took Llama's rotary class, which rotates all 16).

Margins (measured when written, transformers alone): without the o_proj and MLP biases the last
logits move by 10.4-11.5 (max abs, logits' std ~4.2) and greedy output changes on 3 of 3
prompts; the engine must be within 1e-4 x std, and the test requires the removal to move them
by > 1e3 x that. Phi-3 read with factor 1.0 changes the first token on 3 of 3 prompts and the
first-token log-probabilities by 14-17 nats; the engine must be within 1e-4 of transformers',
and the test requires factor 1.0 to be off by > 1e-2 and to change the first token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_loop import greedy_generate, hf_greedy, scattered_blocks
from llama_cpp_converter import convert
from sharp_models import VOCAB_SIZE, write_sharp_checkpoint
from step_cases import prompts
from tiny_models import TINY_LIMITS
from transformers import AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

PROMPT_LENGTHS = [12, 40, 90]
NEW_TOKENS = 8
PARTIAL = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}


def build(source: Path, folder: Path) -> Engine:
    build_engine(source, folder, BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    return Engine.load(folder)


def last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    table = scattered_blocks(engine, len(prompt))
    inputs = build_step_inputs([RequestSlice(prompt, 0, table, sample=True)], engine.config.limits.block_size)
    return engine.step(inputs)[0]


def hf_last_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1]


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("biased") / "hf"
    return write_sharp_checkpoint(folder, "llama", attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("source", ["hf_folder", "llama_cpp_gguf"])
def test_o_proj_and_mlp_biases_follow_the_config(biased_llama: Path, tmp_path: Path, source: str) -> None:
    path = biased_llama if source == "hf_folder" else convert(biased_llama, tmp_path / "biased.gguf", "f32")
    engine = build(path, tmp_path / "engine")
    spec = engine.config.spec
    assert (spec.attention_bias, spec.attention_out_bias, spec.mlp_bias) == (True, True, True)
    hf = AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    without = AutoModelForCausalLM.from_pretrained(biased_llama, dtype=torch.float32).eval()
    with torch.no_grad():  # what the builder computed before: q/k/v biases only
        for layer in without.model.layers:
            for module in (layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                module.bias.zero_()
    for prompt in prompts(VOCAB_SIZE, PROMPT_LENGTHS, seed=5):
        assert greedy_generate(engine, prompt, NEW_TOKENS) == hf_greedy(hf, prompt, NEW_TOKENS), len(prompt)
        theirs = hf_last_logits(hf, prompt)
        tolerance = 1e-4 * float(theirs.std())
        assert (last_logits(engine, prompt) - theirs).abs().max() < tolerance, len(prompt)
        assert (hf_last_logits(without, prompt) - theirs).abs().max() > 1e3 * tolerance, len(prompt)


def test_phi3_partial_rotary_with_plain_rope(tmp_path: Path) -> None:
    """Greedy continuations equal transformers' and first-token log-probabilities within 1e-4;
    transformers with the factor at 1.0 (what the engine computed before) is far off."""
    hf_dir = write_sharp_checkpoint(tmp_path / "phi3", "phi3", rope_parameters=PARTIAL)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.75
    full = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, rope_parameters={**PARTIAL, "partial_rotary_factor": 1.0}
    ).eval()
    engine = build(hf_dir, tmp_path / "engine")
    for prompt in prompts(VOCAB_SIZE, PROMPT_LENGTHS, seed=5):
        expected = hf_greedy(hf, prompt, NEW_TOKENS)
        assert greedy_generate(engine, prompt, NEW_TOKENS) == expected, len(prompt)
        assert hf_greedy(full, prompt, 1) != expected[:1], len(prompt)
        theirs = torch.log_softmax(hf_last_logits(hf, prompt), -1)
        ours = torch.log_softmax(last_logits(engine, prompt), -1)
        assert (ours - theirs).abs().max() < 1e-4, len(prompt)
        assert (torch.log_softmax(hf_last_logits(full, prompt), -1) - theirs).abs().max() > 1e-2, len(prompt)
