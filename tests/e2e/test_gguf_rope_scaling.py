"""RoPE scaling in files llama.cpp's own converter writes, checked against transformers on the HF folder.

Each case is a tiny sharp-attention checkpoint (tests/sharp_models.py) whose `rope_parameters`
scale RoPE, converted to F32 by llama.cpp's `convert_hf_to_gguf.py` (tests/llama_cpp_converter.py):

- Llama with `llama3` scaling: the converter writes no key, only the tensor `rope_freqs.weight`;
- Llama with `linear` scaling: `llama.rope.scaling.type` / `.factor`;
- Qwen3 with `yarn` scaling: `qwen3.rope.scaling.type` / `.factor` / `.original_context_length`.

The oracle is transformers' model loaded from the HF folder, never the GGUF read through our
code. `original_max_position_embeddings` is 64 so the scaling reaches the frequencies at the
prompts' distances (head_dim 16: 7 of Llama's 8 frequency pairs change under llama3; YaRN
changes 15 of Qwen3's 16 and scales cos/sin by 1.139).

Margin (measured when written): with the scaling removed, transformers' first greedy token
differs on 5 of 5 prompts and its last logits move by 10-17 (max abs, logits' std ~4), while the
engine's are within 5e-5 of transformers' with it; the test requires the former on every
prompt and the latter within 1e-4 x the logits' std, so a builder that drops the scaling fails
every prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_loop import greedy_generate, hf_greedy, scattered_blocks
from llama_cpp_converter import convert_many
from sharp_models import VOCAB_SIZE, write_sharp_checkpoint
from step_cases import prompts
from tiny_models import TINY_LIMITS
from transformers import AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

THETA = 10000.0
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "llama",
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "linear": ("llama", dict(rope_type="linear", factor=4.0)),
    "yarn": ("qwen3", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
}
# the context YaRN's factor stretches the original to (transformers warns where they disagree)
MAX_POSITIONS = {"yarn": 256}
PROMPT_LENGTHS = [40, 80, 120, 160, 200]  # past original_max_position_embeddings; + 8 within max_seq_len 256
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each case's HF folder and the GGUF llama.cpp's converter makes of it (one converter run)."""
    root = tmp_path_factory.mktemp("rope_scaling")
    folders = {}
    for name, (family, scaling) in CASES.items():
        rope = {"rope_theta": THETA, **scaling}
        positions = MAX_POSITIONS.get(name, 512)
        folders[name] = write_sharp_checkpoint(
            root / name, family, rope_parameters=rope, max_position_embeddings=positions
        )
    files = convert_many([(folder, root / f"{name}.gguf", "f32") for name, folder in folders.items()])
    return {name: (folders[name], path) for name, path in zip(folders, files, strict=True)}


@pytest.fixture(scope="module", params=list(CASES))
def case(
    request: pytest.FixtureRequest, converted: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, Engine]:
    name = request.param
    hf_dir, gguf = converted[name]
    folder = tmp_path_factory.mktemp(f"engine_{name}") / "engine"
    build_engine(gguf, folder, BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    return name, hf_dir, Engine.load(folder)


def last_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    table = scattered_blocks(engine, len(prompt))
    inputs = build_step_inputs([RequestSlice(prompt, 0, table, sample=True)], engine.config.limits.block_size)
    return engine.step(inputs)[0]


def test_engine_from_llama_cpps_file_equals_transformers_on_the_hf_folder(case: tuple[str, Path, Engine]) -> None:
    name, hf_dir, engine = case
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == CASES[name][1]["rope_type"]
    plain = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, rope_parameters={"rope_type": "default", "rope_theta": THETA}
    ).eval()
    for prompt in prompts(VOCAB_SIZE, PROMPT_LENGTHS, seed=7):
        expected = hf_greedy(hf, prompt, NEW_TOKENS)
        assert greedy_generate(engine, prompt, NEW_TOKENS) == expected, (name, len(prompt))
        # the scaling matters here: without it transformers' very first token is another
        assert hf_greedy(plain, prompt, 1) != expected[:1], (name, len(prompt))
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0, -1]
            unscaled = plain(torch.tensor([prompt])).logits[0, -1]
        ours = last_logits(engine, prompt)
        tolerance = 1e-4 * float(theirs.std())
        assert (ours - theirs).abs().max() < tolerance, (name, len(prompt), (ours - theirs).abs().max())
        assert (unscaled - theirs).abs().max() > 1e3 * tolerance, (name, len(prompt))
