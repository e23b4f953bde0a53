"""Gemma 2 (Gemma2ForCausalLM) through the real builder, from an HF folder and from a GGUF.

Pins what Gemma 2 adds to the Gemma path test_gemma3.py pins: attention-logit soft-capping
(each scaled score s becomes cap * tanh(s / cap) before the mask and softmax, in the capped
context path that replaces SDPA, the torch decode path, the reference loops and the decode
kernel's softcap op) and final-logit soft-capping, with one RoPE table for every layer and no
q/k norms; the local/global pattern (even layers local) and the caps read from transformers'
Gemma2Config and from llama.cpp's `gemma2` GGUF keys. Greedy output and last logits equal
transformers fp32 (its eager attention, the only one that caps), whole and chunked across the
window's edges; on the Q8_0 GGUF engine a prompt's logits are bitwise the same alone, batched,
chunked and after a reused prefix.

The caps are small (2 and 3) so that they bend the tiny model's scores and logits: with the
attention cap left out the last logits of the three greedy prompts move by 0.013-0.024, with
the final one by 0.2-0.47 (transformers with each cap set to None), against the 2e-5 these tests
allow.
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
from tiny_models import tiny_config, write_gguf, write_hf_checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.sources import gguf_config
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine

WINDOW = 8
CAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers (local, global, local, global); the attention scale 24 ** -0.5, not head_dim's."""
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("tiny-gemma2"),
        "gemma2",
        seed=3,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        **CAPS,
    )


@pytest.fixture(scope="module")
def folder_engine(tmp_path_factory: pytest.TempPathFactory, gemma_dir: Path) -> Path:
    return build_fp32(gemma_dir, tmp_path_factory.mktemp("engines") / "gemma2-fp32")


def _assert_greedy_equals(engine: Engine, hf: torch.nn.Module) -> None:
    # chunks that start inside, at and past a window; then 20 decodes on, deeper past it
    assert_greedy_equals(engine, hf, [5, 23, 40], 20, chunks=(3, WINDOW + 1, 16), deep=True)


def test_the_spec_read_from_a_folder(gemma_dir: Path) -> None:
    """transformers' Gemma2Config gives this spec. (llama.cpp's file of the same checkpoint gives
    the same spec but for the attention scale, taken from head_dim as llama.cpp does:
    test_converter_conformance.py's gemma2 and gemma2-scalar cases.)"""
    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(gemma_dir))
    assert spec.architecture == "gemma2" and spec.tie_word_embeddings and not spec.qk_norm
    assert (spec.sliding_window, spec.full_attention_layers) == (WINDOW, (1, 3))
    assert (spec.local_rope_theta, spec.hidden_act, spec.norm_weight_offset) == (None, "gelu_pytorch_tanh", 1.0)
    assert (spec.embed_scale, spec.sandwich_norms, spec.attention_scale) == (8.0, True, 24**-0.5)
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (2.0, 3.0)


def test_a_gguf_without_the_cap_keys_has_no_caps(tmp_path: Path) -> None:
    """transformers' GGUF reader leaves Gemma2Config's 50/30 whatever the file says; the file's
    keys decide (absent: none, as llama.cpp then runs it). The file is our converter double's
    (tests/tiny_models.write_gguf): llama.cpp's convert_hf_to_gguf.py cannot write a Gemma 2
    without caps (it packs the None as a float and fails with struct.error), so only a file made
    some other way can lack the keys."""
    folder = write_hf_checkpoint(
        tmp_path / "hf", "gemma2", seed=1, attn_logit_softcapping=None, final_logit_softcapping=None
    )
    spec = model_spec_from_hf_config(gguf_config(write_gguf(tmp_path / "uncapped.gguf", folder)))
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (None, None)


def test_folder_engine_equals_transformers(gemma_dir: Path, folder_engine: Path) -> None:
    """Dense fp32 engine (the capped context path instead of SDPA, the masked decode path)."""
    engine = Engine.load(folder_engine, StepMode.COMPILED)
    assert engine.config.spec.attn_logit_softcap == 2.0
    _assert_greedy_equals(engine, AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval())


def test_compiled_eager_and_reference_paths_agree(gemma_dir: Path, folder_engine: Path) -> None:
    """One mixed step (a chunk past the window over cached context, a whole prompt, a deep
    decode) in the three step modes of the folder's engine; the reference's logits are
    transformers'. (The Q8_0 file's engine: test_converter_conformance.py.)"""
    assert_step_modes_agree(folder_engine, AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval())


def test_gemma3_takes_the_caps_too() -> None:
    """Gemma 3's releases set no caps, but its transformers model applies them where a config
    does: read, not refused; a cap <= 0 is refused naming the field."""
    spec = model_spec_from_hf_config(tiny_config("gemma3_text", 320, **CAPS))
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (2.0, 3.0)
    with pytest.raises(UnsupportedModelError, match="attn_logit_softcapping must be > 0"):
        model_spec_from_hf_config(tiny_config("gemma2", 320, attn_logit_softcapping=0.0))
