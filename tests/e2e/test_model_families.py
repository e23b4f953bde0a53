"""Model families beyond Llama through the real builder: Qwen3 from an HF folder and from a GGUF,
SmolLM3 (NoPE layers) from an HF folder.

Pins: Qwen3's per-head q/k RMSNorm is recorded and applied (greedy equals transformers fp32 on an
HF folder, and transformers' own GGUF load on a Q8_0 GGUF whose blocks stay blocks), head_dim is
read from the GGUF's `attention.key_length` rather than derived from hidden/heads, and a Qwen3
engine without the norms' tensors is refused naming them; SmolLM3's layers without RoPE are
recorded and skip it (greedy equals transformers), and its sliding-window variant is refused.

The tiny models' random N(0, 0.08) weights make every attention score ~0 (attention uniform), so
a network that got q/k norms or RoPE wrong gave the same greedy tokens; each fixture here scales
the weights that shape the scores to trained-like sizes, and each test was checked to fail with
the feature removed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
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


@pytest.fixture(scope="module")
def smollm3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM3 with layer 1 of 2 NoPE; attention made position-sensitive (see the docstring)."""
    from safetensors.torch import load_file, save_file

    folder = write_hf_checkpoint(tmp_path_factory.mktemp("tiny-smollm3"), "smollm3", seed=5)
    state = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    for name, tensor in state.items():
        if name.endswith("input_layernorm.weight"):
            state[name] = 1 + 0.1 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            state[name] = tensor * 3
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _build(source: Path, output: Path) -> Path:
    build_engine(source, output, BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    return output


def test_qwen3_folder_engine_greedy_equals_transformers(qwen3_dir: Path, tmp_path: Path) -> None:
    engine = Engine.load(_build(qwen3_dir, tmp_path / "qwen3"), StepMode.COMPILED)
    spec = engine.config.spec
    assert (spec.architecture, spec.qk_norm, spec.head_dim, spec.attention_bias) == ("qwen3", True, 32, False)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    for prompt in prompts(spec.vocab_size, [5, 23, 40], seed=7):
        expected = hf_greedy(hf, prompt, 24)
        assert greedy_generate(engine, prompt, 24) == expected
        assert greedy_generate(engine, prompt, 24, chunk=16) == expected


def test_qwen3_gguf_keeps_blocks_and_equals_transformers_gguf_loader(qwen3_gguf: Path, tmp_path: Path) -> None:
    engine = Engine.load(_build(qwen3_gguf, tmp_path / "qwen3-q8"), StepMode.COMPILED)
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
    engine = Engine.load(_build(smollm3_dir, tmp_path / "smollm3"), StepMode.COMPILED)
    spec = engine.config.spec
    assert (spec.architecture, spec.no_rope_layers) == ("smollm3", (1,))
    hf = AutoModelForCausalLM.from_pretrained(smollm3_dir, dtype=torch.float32).eval()
    for prompt in prompts(spec.vocab_size, [5, 23, 40], seed=7):
        expected = hf_greedy(hf, prompt, 24)
        assert greedy_generate(engine, prompt, 24) == expected
        assert greedy_generate(engine, prompt, 24, chunk=16) == expected


def test_smollm3_with_a_sliding_window_is_refused(tmp_path: Path) -> None:
    from ifb.builder.errors import UnsupportedModelError

    folder = write_hf_checkpoint(tmp_path / "sliding", "smollm3", use_sliding_window=True, sliding_window=32)
    with pytest.raises(UnsupportedModelError, match="sliding-window attention"):
        build_engine(folder, tmp_path / "engine", BuildOptions(dtype="fp32", **TINY_LIMITS))


def _hf_config_with_head_dim(path: Path) -> object:
    """The oracle's config: transformers' GGUF reader ignores key_length (see builder/sources.py)."""
    from ifb.builder.sources import gguf_config

    return gguf_config(path)
