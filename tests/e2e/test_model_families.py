"""Model families beyond Llama through the real builder, from their HF folders: Qwen3, SmolLM3
(NoPE layers), Phi-3 / Phi-4-mini (fused tensors, LongRoPE, partial rotary).

Pins: Qwen3's per-head q/k RMSNorm is recorded and applied (greedy equals transformers fp32 on the
HF folder), and a Qwen3 checkpoint without the norms' tensors is refused naming them; SmolLM3's
layers without RoPE are recorded and skip it (greedy equals transformers); Phi-3's LongRoPE
tables and partial rotary.

The same families as llama.cpp's convert_hf_to_gguf.py writes them (F32 and Q8_0, blocks kept,
head_dim from `attention.key_length`, SmolLM3's every-4th NoPE layer, Qwen2's q/k/v biases,
Phi-3's fused tensors, rope.dimension_count and rope_factors_*): test_converter_conformance.py,
against transformers on the HF folder.

The tiny models' random N(0, 0.08) weights make every attention score ~0 (attention uniform), so
a network that got q/k norms or RoPE wrong gave the same greedy tokens; each fixture here scales
the weights that shape the scores to trained-like sizes, and each test was checked to fail with
the feature removed.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from family_checks import assert_last_logits_close, build_fp32
from greedy_loop import greedy_generate, hf_greedy
from step_cases import prompts
from tiny_models import TINY_LIMITS, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.errors import SourceError
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 as the small releases are: tied head, no bias, head_dim 32 != 64 / 4 heads.

    The q/k norm weights are set near 1.5 (trained ones are O(1)): at the tiny models' random
    N(0, 0.08) they made every score ~0, attention uniform, and a network without the norms
    gave the same greedy tokens, so the test could not fail."""
    from safetensors.torch import load_file, save_file

    folder = write_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", seed=4, tie_word_embeddings=True)
    state = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(4)
    for name, tensor in state.items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            state[name] = 1.5 + 0.3 * torch.randn(tensor.shape, generator=generator)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _smollm3_checkpoint(folder: Path, seed: int, **overrides: object) -> Path:
    """A SmolLM3 whose attention is position-sensitive: input norms near 1 and q/k scaled up (at
    the tiny models' random N(0, 0.08), scores are ~0 and a NoPE layer looks like any other)."""
    from safetensors.torch import load_file, save_file

    write_hf_checkpoint(folder, "smollm3", seed=seed, **overrides)
    state = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        if name.endswith("input_layernorm.weight"):
            state[name] = 1 + 0.1 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            state[name] = tensor * 3
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM3 with layer 1 of 2 NoPE."""
    return _smollm3_checkpoint(tmp_path_factory.mktemp("tiny-smollm3"), seed=5)


def test_qwen3_folder_engine_greedy_equals_transformers(qwen3_dir: Path, tmp_path: Path) -> None:
    engine = Engine.load(build_fp32(qwen3_dir, tmp_path / "qwen3"), StepMode.COMPILED)
    spec = engine.config.spec
    assert (spec.architecture, spec.qk_norm, spec.head_dim, spec.attention_bias) == ("qwen3", True, 32, False)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    for prompt in prompts(spec.vocab_size, [5, 23, 40], seed=7):
        expected = hf_greedy(hf, prompt, 24)
        assert greedy_generate(engine, prompt, 24) == expected
        assert greedy_generate(engine, prompt, 24, chunk=16) == expected


def test_qwen3_without_its_qk_norm_tensors_is_refused_naming_them(qwen3_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "no-norms"
    folder.mkdir()
    for file in qwen3_dir.iterdir():
        if file.suffix != ".safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    state = load_file(str(qwen3_dir / "model.safetensors"))
    save_file({k: v for k, v in state.items() if "q_norm" not in k}, str(folder / "model.safetensors"))
    with pytest.raises(SourceError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
        build_engine(folder, tmp_path / "engine", BuildOptions(dtype="fp32", **TINY_LIMITS))


def test_smollm3_nope_layers_are_recorded_and_greedy_equals_transformers(smollm3_dir: Path, tmp_path: Path) -> None:
    engine = Engine.load(build_fp32(smollm3_dir, tmp_path / "smollm3"), StepMode.COMPILED)
    spec = engine.config.spec
    assert (spec.architecture, spec.no_rope_layers) == ("smollm3", (1,))
    hf = AutoModelForCausalLM.from_pretrained(smollm3_dir, dtype=torch.float32).eval()
    for prompt in prompts(spec.vocab_size, [5, 23, 40], seed=7):
        expected = hf_greedy(hf, prompt, 24)
        assert greedy_generate(engine, prompt, 24) == expected
        assert greedy_generate(engine, prompt, 24, chunk=16) == expected


# -- Phi-3 / Phi-4-mini -------------------------------------------------------------------------
PHI3_ROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.5, 4.0],
    "long_factor": [2.0, 4.0, 8.0, 16.0],
}


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-4-mini's shape of RoPE: LongRoPE over half of each 16-wide head (partial_rotary_factor
    0.5), original window 256 = the tiny engines' max_seq_len (so the short factors apply, as in
    transformers for these prompts), and fused qkv_proj / gate_up_proj tensors. q/k scaled 10x
    so attention depends on positions: even then the long factors change the tiny model's last
    logits by only ~2e-3 and no greedy token, so the tests compare logits too."""
    from safetensors.torch import load_file, save_file

    folder = write_hf_checkpoint(
        tmp_path_factory.mktemp("tiny-phi3"),
        "phi3",
        seed=6,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=256,
        rope_scaling=PHI3_ROPE,
    )
    state = load_file(str(folder / "model.safetensors"))
    for name, tensor in state.items():
        if name.endswith("qkv_proj.weight"):
            q_and_k = 64 + 32  # q: 4 heads x 16, k: 2 heads x 16
            tensor[:q_and_k] *= 10
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_phi3_folder_engine_greedy_equals_transformers(phi3_dir: Path, tmp_path: Path) -> None:
    """Fused qkv / gate_up read in our row order, LongRoPE's short factors and attention scaling,
    rotation over the first half of each head only."""
    engine = Engine.load(build_fp32(phi3_dir, tmp_path / "phi3"), StepMode.COMPILED)
    spec = engine.config.spec
    assert (spec.architecture, spec.head_dim) == ("phi3", 16)
    assert engine.config.rope_scaling == pytest.approx(math.sqrt(1 + math.log(2) / math.log(256)))
    hf = AutoModelForCausalLM.from_pretrained(phi3_dir, dtype=torch.float32).eval()
    for prompt in prompts(spec.vocab_size, [5, 23, 40], seed=7):
        expected = hf_greedy(hf, prompt, 24)
        assert greedy_generate(engine, prompt, 24) == expected
        assert greedy_generate(engine, prompt, 24, chunk=16) == expected
        assert_last_logits_close(engine, hf, prompt)


def test_phi3_long_factors_apply_past_the_original_window(phi3_dir: Path) -> None:
    """An engine longer than original_max_position_embeddings takes the long factors (for every
    position, as llama.cpp does). (A checkpoint's sliding window: tests/e2e/test_sliding_window.py.)"""
    from transformers import AutoConfig

    from ifb.builder.build import rope_tables

    config = AutoConfig.from_pretrained(phi3_dir)
    short, _ = rope_tables(config, 256)
    long, _ = rope_tables(config, 512)
    base = 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    assert torch.allclose(short, 1 / (torch.tensor(PHI3_ROPE["short_factor"]) * base))
    assert torch.allclose(long, 1 / (torch.tensor(PHI3_ROPE["long_factor"]) * base))
