"""A user's own GGUF: K-quant and Q5 tensors kept in their own formats, per part of a fused module.

Pins: a file mixed like llama.cpp's Q4_K_M (q/k Q4_K, v Q6_K, down Q5_0, tied head/embedding
Q6_K) builds into an engine whose weight formats are the file's own, with no fp32 vocabulary
table; its exact-compute greedy output equals transformers' (dequantizing) load of the same
file; `--compute auto` picks int8 here and records it; a tensor type without a kernel (Q3_K) is
stored dense with one warning naming it; a second file covers Q5_K, Q5_1 and an untied Q8_0
embedding beside a Q5_K head.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from greedy_loop import greedy_generate, hf_greedy
from safetensors import safe_open
from step_cases import prompts, run_mixed_step
from tiny_models import Q4_K_M_LIKE, TINY_LIMITS, write_gguf, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine

# Rows of 256 weights are what K-quants need; the tiny models' 64-wide rows are too short.
KQUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# Q5_K / Q5_1 / Q8_0, an untied Q5_K head beside a Q8_0 embedding, and one Q3_K tensor.
OTHER_FORMATS = {
    "attn_q": "Q5_K",
    "attn_k": "Q5_K",
    "attn_v": "Q5_K",
    "attn_output": "Q5_1",
    "ffn_gate": "Q5_K",
    "ffn_up": "Q5_K",
    "ffn_down": "Q5_1",
    "blk.1.ffn_down.weight": "Q3_K",
    "token_embd.weight": "Q8_0",
    "output.weight": "Q5_K",
}


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_hf_checkpoint(
        tmp_path_factory.mktemp("kq-hf"), "llama", seed=3, tie_word_embeddings=True, **KQUANT_SHAPE
    )
    return write_gguf(tmp_path_factory.mktemp("kq") / "tiny-q4_k_m.gguf", folder, tensor_types=Q4_K_M_LIKE, seed=3)


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_hf_checkpoint(tmp_path_factory.mktemp("k5-hf"), "llama", seed=4, **KQUANT_SHAPE)
    return write_gguf(tmp_path_factory.mktemp("k5") / "tiny-q5.gguf", folder, tensor_types=OTHER_FORMATS, seed=4)


def _build(source: Path, folder: Path, compute: str) -> Path:
    build_engine(source, folder, BuildOptions(compute=compute, **TINY_LIMITS))
    return folder


@pytest.fixture(scope="module")
def q4_k_m_exact_engine(q4_k_m_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(q4_k_m_gguf, tmp_path_factory.mktemp("engines") / "q4_k_m-fp32", "fp32")


def _hf(gguf_file: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()


def test_q4_k_m_parts_keep_their_own_formats(q4_k_m_exact_engine: Path) -> None:
    """Each GGUF part is stored in its file format; the tied embedding reads the head's Q6_K tiles."""
    config = EngineConfig.load(q4_k_m_exact_engine)
    for i in range(config.spec.num_layers):
        assert config.weight_formats[f"layers.{i}.attn.qkv[0]"] == "q4_k"
        assert config.weight_formats[f"layers.{i}.attn.qkv[1]"] == "q4_k"
        assert config.weight_formats[f"layers.{i}.attn.qkv[2]"] == "q6_k"
        assert config.weight_formats[f"layers.{i}.attn.o_proj"] == "q4_k"
        assert config.weight_formats[f"layers.{i}.mlp.gate_up"] == "q4_k"
        assert config.weight_formats[f"layers.{i}.mlp.down"] == "q5_0"
    assert config.weight_formats["lm_head"] == "q6_k" and config.weight_formats["embed"] == "q6_k"
    assert config.weight_compute == "fp32"
    with safe_open(str(config.weights_path), framework="pt") as weights:
        names = set(weights.keys())
    assert "embed.weight" not in names and "embed.packed" not in names  # no fp32 table, no second copy
    assert not any(name.endswith(".weight") and ("qkv" in name or "mlp" in name) for name in names)


def test_q4_k_m_greedy_equals_transformers_gguf_load(q4_k_m_gguf: Path, q4_k_m_exact_engine: Path) -> None:
    """Exact compute: token-for-token what transformers computes on the dequantized file."""
    engine = Engine.load(q4_k_m_exact_engine, StepMode.COMPILED)
    hf = _hf(q4_k_m_gguf)
    for prompt in prompts(engine.config.spec.vocab_size, [5, 23, 40], seed=11):
        expected = hf_greedy(hf, prompt, 16)
        assert greedy_generate(engine, prompt, 16) == expected
        assert greedy_generate(engine, prompt, 16, chunk=16) == expected


def test_compute_auto_picks_int8_and_stays_close(q4_k_m_gguf: Path, q4_k_m_exact_engine: Path, tmp_path: Path) -> None:
    """`--compute auto` (the default) builds int8 compute on this CPU; its logits track the exact engine's."""
    folder = _build(q4_k_m_gguf, tmp_path / "auto", "auto")
    config = EngineConfig.load(folder)
    assert config.weight_compute == "int8" and config.build_options.compute == "auto"
    exact = run_mixed_step(Engine.load(q4_k_m_exact_engine, StepMode.COMPILED))
    approx = run_mixed_step(Engine.load(folder, StepMode.COMPILED))
    cosine = torch.nn.functional.cosine_similarity(exact, approx, dim=-1)
    assert cosine.min().item() > 0.99, cosine


def test_other_formats_and_a_type_without_kernel(
    other_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Q5_K/Q5_1/Q8_0 kept; the Q3_K tensor is dequantized with one warning naming it; greedy == transformers."""
    with caplog.at_level(logging.WARNING):
        folder = _build(other_gguf, tmp_path / "q5", "fp32")
    warnings = [r.getMessage() for r in caplog.records if "no kernel" in r.getMessage()]
    assert len(warnings) == 1 and "blk.1.ffn_down.weight (Q3_K)" in warnings[0], warnings
    config = EngineConfig.load(folder)
    assert config.weight_formats["layers.0.attn.qkv"] == "q5_k"
    assert config.weight_formats["layers.0.mlp.down"] == "q5_1"
    assert "layers.1.mlp.down" not in config.weight_formats  # stored dense
    assert config.weight_formats["lm_head"] == "q5_k" and config.weight_formats["embed"] == "q8_0"
    engine = Engine.load(folder, StepMode.COMPILED)
    hf = _hf(other_gguf)
    for prompt in prompts(config.spec.vocab_size, [7, 30], seed=13):
        assert greedy_generate(engine, prompt, 16) == hf_greedy(hf, prompt, 16)


def test_eager_and_reference_modes_match_compiled(q4_k_m_exact_engine: Path) -> None:
    """The segmented qkv and the block embedding behave the same eagerly as compiled."""
    results = {mode: run_mixed_step(Engine.load(q4_k_m_exact_engine, mode)) for mode in StepMode}
    for mode in (StepMode.EAGER, StepMode.REFERENCE):
        assert (results[mode] - results[StepMode.COMPILED]).abs().max().item() < 1e-5, mode
