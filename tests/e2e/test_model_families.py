"""Model families beyond Llama through the real builder: Qwen3 from an HF folder and from a GGUF,
SmolLM3 (NoPE layers) from an HF folder, Phi-3 / Phi-4-mini (fused tensors, LongRoPE, partial
rotary) from both.

Pins: Qwen3's per-head q/k RMSNorm is recorded and applied (greedy equals transformers fp32 on an
HF folder, and transformers' own GGUF load on a Q8_0 GGUF whose blocks stay blocks), head_dim is
read from the GGUF's `attention.key_length` rather than derived from hidden/heads, and a Qwen3
engine without the norms' tensors is refused naming them; SmolLM3's layers without RoPE are
recorded and skip it (greedy equals transformers), and its sliding-window variant (a window on
some layers only) is refused.

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
from family_checks import assert_greedy_equals, assert_last_logits_close, build_fp32, gguf_oracle
from greedy_loop import greedy_generate, hf_greedy
from step_cases import prompts
from tiny_models import TINY_LIMITS, write_gguf, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.errors import SourceError
from ifb.runtime.engine_format import EngineConfig
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


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3-gguf") / "tiny-qwen3-q8_0.gguf"
    return write_gguf(path, qwen3_dir, linear_type="Q8_0", embed_type="Q8_0")


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


def test_qwen3_gguf_keeps_blocks_and_equals_transformers_gguf_loader(qwen3_gguf: Path, tmp_path: Path) -> None:
    engine = Engine.load(build_fp32(qwen3_gguf, tmp_path / "qwen3-q8"), StepMode.COMPILED)
    config = EngineConfig.load(tmp_path / "qwen3-q8")
    assert config.spec.head_dim == 32 and config.spec.qk_norm  # from qwen3.attention.key_length
    assert set(config.weight_formats.values()) == {"q8_0"} and "embed" in config.weight_formats
    hf = AutoModelForCausalLM.from_pretrained(
        qwen3_gguf.parent, gguf_file=qwen3_gguf.name, config=_hf_config_with_head_dim(qwen3_gguf), dtype=torch.float32
    ).eval()
    for prompt in prompts(config.spec.vocab_size, [5, 23, 40], seed=7):
        assert greedy_generate(engine, prompt, 24) == hf_greedy(hf, prompt, 24)


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


def _hf_config_with_head_dim(path: Path) -> object:
    """The oracle's config: transformers' GGUF reader ignores key_length (see builder/sources.py)."""
    from ifb.builder.sources import gguf_config

    return gguf_config(path)


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


def test_phi3_gguf_keeps_blocks_and_reads_its_rope(phi3_dir: Path, tmp_path: Path) -> None:
    """A Q8_0 GGUF as llama.cpp's converter writes Phi-3 (fused attn_qkv, ffn_up = gate then up,
    rope.dimension_count, rope_factors_* tensors): the blocks stay blocks, and the partial
    rotary and LongRoPE that transformers' own GGUF reader drops are read (builder/sources.py)."""
    from ifb.builder.sources import gguf_config

    gguf_path = write_gguf(tmp_path / "tiny-phi3-q8_0.gguf", phi3_dir, linear_type="Q8_0", embed_type="Q8_0")
    config = gguf_config(gguf_path)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    assert config.rope_parameters["long_factor"] == PHI3_ROPE["long_factor"]
    engine = Engine.load(build_fp32(gguf_path, tmp_path / "phi3-q8"), StepMode.COMPILED)
    formats = EngineConfig.load(tmp_path / "phi3-q8").weight_formats
    assert formats["layers.0.attn.qkv"] == "q8_0" and formats["layers.0.mlp.gate_up"] == "q8_0"
    config.pad_token_id = None  # Phi3Config's default (32000) is past the tiny vocabulary
    hf = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, config=config, dtype=torch.float32
    ).eval()
    for prompt in prompts(engine.config.spec.vocab_size, [5, 23, 40], seed=7):
        assert greedy_generate(engine, prompt, 24) == hf_greedy(hf, prompt, 24)
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


def test_smollm3_gguf_keeps_blocks_and_takes_llama_cpps_nope_layers(tmp_path: Path) -> None:
    """llama.cpp writes SmolLM3 as Llama (arch `smollm3`, q/k permuted) with no key for its NoPE
    layers: its graph leaves out RoPE on every 4th layer, as SmolLM3Config's default. A 4-layer
    model with that pattern: layer 3 recorded as NoPE, Q8_0 blocks kept, greedy output and last
    logits equal transformers on the GGUF loader's weights, whole and chunked."""
    folder = _smollm3_checkpoint(tmp_path / "hf", seed=6, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    path = write_gguf(tmp_path / "tiny-smollm3-q8_0.gguf", folder, linear_type="Q8_0", embed_type="Q8_0")
    engine = Engine.load(build_fp32(path, tmp_path / "engine"), StepMode.COMPILED)
    config = engine.config
    assert (config.spec.architecture, config.spec.no_rope_layers) == ("smollm3", (3,))
    assert set(config.weight_formats.values()) == {"q8_0"}
    assert_greedy_equals(engine, gguf_oracle(path), [5, 23, 40], 24, chunks=(16,))


def test_qwen2_gguf_keeps_blocks_and_its_qkv_bias(tmp_path: Path) -> None:
    """Qwen2 as llama.cpp writes it (arch qwen2, q/k not permuted, attn_q/k/v.bias as F32 beside
    Q8_0 weights): the bias is read into the fused qkv, greedy output and last logits equal
    transformers on the GGUF loader's weights."""
    folder = write_hf_checkpoint(tmp_path / "hf", "qwen2", seed=9)
    path = write_gguf(tmp_path / "tiny-qwen2-q8_0.gguf", folder, linear_type="Q8_0", embed_type="Q8_0")
    engine = Engine.load(build_fp32(path, tmp_path / "engine"), StepMode.COMPILED)
    config = engine.config
    assert (config.spec.architecture, config.spec.attention_bias) == ("qwen2", True)
    assert set(config.weight_formats.values()) == {"q8_0"}
    assert_greedy_equals(engine, gguf_oracle(path), [5, 23, 40], 24, chunks=(16,))
