"""Gemma 3 text (Gemma3ForCausalLM) through the real builder, from an HF folder and from a GGUF.

Pins: the spec read from transformers' Gemma3TextConfig and from llama.cpp's `gemma3` GGUF, and
the network's Gemma path: RMSNorm scaling by (1 + w) in fp32 (llama.cpp's file stores 1 + w,
taken off once), embeddings times sqrt(hidden), GeGLU with gelu's tanh approximation, four norms
a layer, q/k norms, the query_pre_attn_scalar attention scale, and interleaved local layers
(window 8, RoPE base rope_local_base_freq) and global ones (no window, rope_theta with linear
scaling). Greedy output and last logits equal transformers fp32 for prompts shorter and longer
than the window, prefilled whole or in chunks across its edges; on the block-quantized GGUF
engine (the decode kernel, windowed on local layers only) a prompt's logits are bitwise the
same alone, batched, chunked and after a reused prefix.

The tiny model's random weights make each of these matter: with the network's (1 + w), embed
scale, local RoPE table, per-layer window (none, or on every layer), attention scale, GeGLU or
sandwich norms disabled, its last logits move by 0.5-3 (exact gelu instead of tanh's: 8e-4),
against the 2e-5 these tests allow, and greedy output changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checks import (
    assert_greedy_equals,
    assert_step_modes_agree,
    build_fp32,
)
from tiny_models import tiny_config, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine

WINDOW = 8
PROMPT_LENGTHS = [5, 23, 40]  # shorter than the window, and longer
GLOBAL_ROPE = {"rope_type": "linear", "factor": 8.0}  # the 4B-27B's global layers


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six layers, llama.cpp's pattern (five local, then one global); the attention scale 24 ** -0.5,
    not head_dim's (16), so it is read rather than assumed."""
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "gemma3_text",
        seed=3,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        rope_scaling=GLOBAL_ROPE,
    )


@pytest.fixture(scope="module")
def folder_engine(tmp_path_factory: pytest.TempPathFactory, gemma_dir: Path) -> Path:
    return build_fp32(gemma_dir, tmp_path_factory.mktemp("engines") / "gemma3-fp32")


def _assert_greedy_equals(engine: Engine, hf: torch.nn.Module) -> None:
    # chunks that start inside, at and past a window; then 20 decodes on, deeper past it
    assert_greedy_equals(engine, hf, PROMPT_LENGTHS, 20, chunks=(3, WINDOW + 1, 16), deep=True)


def test_the_spec_read_from_a_folder(gemma_dir: Path) -> None:
    """transformers' Gemma3TextConfig gives this spec. (llama.cpp's file of the same checkpoint
    gives the same spec but for the attention scale, which llama.cpp takes from head_dim
    (query_pre_attn_scalar = 256 = head_dim in the 1B-12B): test_converter_conformance.py's
    gemma3 and gemma3-scalar cases.)"""
    from transformers import AutoConfig

    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(gemma_dir))
    assert spec.architecture == "gemma3_text" and spec.tie_word_embeddings and spec.qk_norm
    assert (spec.sliding_window, spec.full_attention_layers) == (WINDOW, (5,))
    assert [spec.layer_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert (spec.local_rope_theta, spec.hidden_act, spec.norm_weight_offset) == (10000.0, "gelu_pytorch_tanh", 1.0)
    assert (spec.embed_scale, spec.sandwich_norms, spec.attention_scale) == (8.0, True, 24**-0.5)


def test_folder_engine_equals_transformers(gemma_dir: Path, folder_engine: Path) -> None:
    """Dense fp32 engine (SDPA context path, masked decode path): local layers windowed, the
    global one not, each with its own RoPE; max_seq_len 256 = 32 windows."""
    engine = Engine.load(folder_engine, StepMode.COMPILED)
    assert engine.config.spec.full_attention_layers == (5,)
    _assert_greedy_equals(engine, AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval())


def test_compiled_eager_and_reference_paths_agree(gemma_dir: Path, folder_engine: Path) -> None:
    """One mixed step (a chunk past the window over cached context, a whole prompt, a deep
    decode) in the three step modes of the folder's engine; the reference's logits are
    transformers'. (The Q8_0 file's engine: test_converter_conformance.py.)"""
    assert_step_modes_agree(folder_engine, AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval())


def test_layer_types_decide_the_windows_and_rope_tables() -> None:
    """Any pattern of layer_types: global layers take no window and the global RoPE; with no
    global layer every layer slides on the one (local) table; with no local layer, no window."""
    mixed = model_spec_from_hf_config(
        tiny_config(
            "gemma3_text",
            320,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        )
    )
    assert [mixed.layer_window(i) for i in range(3)] == [None, WINDOW, None]
    assert [mixed.uses_local_rope(i) for i in range(3)] == [False, True, False]
    local = model_spec_from_hf_config(tiny_config("gemma3_text", 320, num_hidden_layers=2, sliding_window_pattern=3))
    assert (local.sliding_window, local.full_attention_layers, local.local_rope_theta) == (4096, (), None)
    dense = tiny_config("gemma3_text", 320, num_hidden_layers=2, layer_types=["full_attention"] * 2)
    spec = model_spec_from_hf_config(dense)
    assert (spec.sliding_window, spec.local_rope_theta, spec.layer_window(0)) == (None, None, None)
