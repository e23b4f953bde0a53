"""Mixtral (Mixtral-8x7B's architecture) from an HF folder and from llama.cpp's F32 and Q8_0 files
of it, built by `ifb build`, against transformers' MixtralForCausalLM on the HF folder.

Input: a tiny seeded MixtralForCausalLM (8 experts, 2 per token; the router's softmax over the
top-k logits) with trained-like scales and a router twice as sharp (tests/moe_checks.py), saved by
transformers (`block_sparse_moe.experts.{e}.w1/w2/w3`, as the released checkpoints). Engines,
each compiled: dense fp32 experts from the folder, and llama.cpp's converter's F32 and Q8_0 files
(arch `llama` with `llama.expert_count`, q/k rows permuted, stacked `ffn_{gate,up,down}_exps`,
`ffn_gate_inp`), their blocks kept; for Q8_0 the oracle's weights are first rounded as the file
holds them.

Checks: greedy continuations of three prompts over 16 tokens equal transformers'; the first
prompt's last logits within TOLERANCE x their std (test_moe_qwen3.py's); every token's routing
decisions in every layer equal transformers' on the three prompts (no two experts tie there);
leaving the top-k unnormalized moves the logits by far more than the tolerance. A dense `llama`
file still reads as Llama, and a file of per-expert tensors (older converters) is refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from greedy_loop import greedy_generate, hf_greedy
from moe_checks import (
    converted_sources,
    eager_moe_engine,
    engine_builder,
    logit_error,
    oracle,
    reference,
    routing,
    write_moe_folder,
)
from sharp_models import VOCAB_SIZE
from step_cases import prompts
from transformers import AutoConfig, MixtralConfig

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families import FAMILIES, gguf_family
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.sources import gguf_config

NEW_TOKENS = 16
PROMPT_LENGTHS = (11, 20, 29)
# test_moe_qwen3.py's. Measured on the three prompts: dense fp32 and the F32 file 1.4-3.8e-6 x std,
# the Q8_0 file 1.6-6.1e-6 against the rounded oracle (0.07-0.20, and 2 of 3 continuations
# changed, against the unrounded one)
TOLERANCE = 1e-4
# Leaving the top-k unnormalized must move the logits by >= this many tolerances (measured
# 0.42-0.84 x std)
MARGIN = 300


def mixtral_config(**overrides: Any) -> MixtralConfig:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,  # one expert's; a multiple of 32: the down projection's K takes Q8_0 blocks
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return MixtralConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = write_moe_folder(tmp_path_factory.mktemp("mixtral") / "hf", mixtral_config())
    return converted_sources(folder)


@pytest.fixture(scope="module")
def engines(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    get, built = engine_builder(sources, tmp_path_factory.mktemp("mixtral-engines"))
    yield get
    built.clear()


def test_the_spec_carries_the_experts(sources: dict[str, Path]) -> None:
    """From the folder and from llama.cpp's `llama` files alike: the expert count makes the file
    a Mixtral (transformers' GGUF reader alone would read a dense Llama and find no MLP)."""
    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(sources["hf"]))
    assert (spec.architecture, spec.num_experts, spec.num_experts_per_tok) == ("mixtral", 8, 2)
    assert (spec.moe_intermediate_size, spec.norm_topk_prob, spec.qk_norm) == (64, True, False)
    for outtype in ("f32", "q8_0"):
        reader = gguf.GGUFReader(str(sources[outtype]))
        assert gguf_family("llama", reader) is FAMILIES["mixtral"]
        from_file = model_spec_from_hf_config(gguf_config(sources[outtype]))
        assert from_file.rms_norm_eps == pytest.approx(spec.rms_norm_eps, rel=1e-6)  # stored as float32
        assert replace(from_file, rms_norm_eps=spec.rms_norm_eps) == spec


def _write_gguf(path: Path, tensors: dict[str, np.ndarray], experts: int) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_dense_llama_file_stays_llama(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "dense.gguf", {"blk.0.ffn_gate.weight": np.zeros((8, 32), np.float32)}, 0)
    assert gguf_family("llama", gguf.GGUFReader(str(path))) is FAMILIES["llama"]


def test_per_expert_tensors_of_older_converters_are_refused_by_name(tmp_path: Path) -> None:
    tensors = {f"blk.0.ffn_{part}.{e}.weight": np.zeros((8, 32), np.float32) for part in ("gate", "up") for e in (0, 1)}
    path = _write_gguf(tmp_path / "old.gguf", tensors, 4)
    config = mixtral_config()
    with pytest.raises(
        UnsupportedModelError, match=r"each expert as its own tensor \(blk.0.ffn_gate.0.weight.*stacked"
    ):
        FAMILIES["mixtral"].read_gguf(config, gguf.GGUFReader(str(path)))


@pytest.mark.parametrize("name", ["dense-fp32", "gguf-f32", "gguf-q8_0"])
def test_engine_matches_transformers(name: str, sources: dict[str, Path], engines: Any) -> None:
    """Greedy tokens equal over 16 tokens for three prompts (the longest also prefilled in chunks
    of 5); the first prompt's last logits within the tolerance x std."""
    hf, engine = reference(name, sources["hf"]), engines(name)
    expected_formats = {"fp32"} if name != "gguf-q8_0" else {"q8_0", "fp32"}
    assert set(engine.config.weight_formats.values()) <= expected_formats, engine.config.weight_formats
    texts = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)
    error = logit_error(engine, hf, texts[0])
    assert error <= TOLERANCE, f"{name}: max logit error {error:.2e} x std"
    for text in texts:
        expected = hf_greedy(hf, text, NEW_TOKENS)
        assert greedy_generate(engine, text, NEW_TOKENS) == expected, (name, len(text))
    assert greedy_generate(engine, texts[-1], NEW_TOKENS, chunk=5) == expected, name


def test_routing_decisions_equal_transformers(sources: dict[str, Path], engines: Any) -> None:
    """Every prompt token's top-2 experts, in both layers, as transformers picks them."""
    eager, blocks = eager_moe_engine(engines("dense-fp32"))
    hf = oracle(sources["hf"])
    for text in prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11):
        for layer, (ours, theirs) in enumerate(routing(eager, blocks, hf, text)):
            assert ours == theirs, (len(text), layer)


def test_leaving_the_top_k_unnormalized_fails_the_check(sources: dict[str, Path], engines: Any) -> None:
    """The dense engine's own network, run eagerly without the top-k renormalization, is far from
    transformers: the tolerance above would catch an engine that skipped it."""
    eager, blocks = eager_moe_engine(engines("dense-fp32"))
    text = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)[0]
    hf = oracle(sources["hf"])
    assert logit_error(eager, hf, text) <= TOLERANCE
    for block in blocks:
        block.norm_topk_prob = False
    moved = logit_error(eager, hf, text)
    assert moved >= MARGIN * TOLERANCE, f"unnormalized top-k: logits move {moved:.2e} x std"
