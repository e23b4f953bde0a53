"""OLMoE (OLMoE-1B-7B's architecture) from an HF folder and from llama.cpp's F32 and Q8_0 files of
it, built by `ifb build`, against transformers' OlmoeForCausalLM on the HF folder.

Input: a tiny seeded OlmoeForCausalLM (8 experts, 2 per token, norm_topk_prob False as the
released ones, q/k RMS-normalized over all heads together) with trained-like scales and a router
twice as sharp (tests/moe_checks.py), saved by transformers (per-expert tensors, as the released
checkpoints). Engines, each compiled: dense fp32 experts from the folder, and llama.cpp's
converter's F32 and Q8_0 files (arch `olmoe`, stacked `ffn_{gate,up,down}_exps`, `ffn_gate_inp`,
`attn_{q,k}_norm` of the whole width), their blocks kept; for Q8_0 the oracle's weights are
first rounded as the file holds them.

Checks: greedy continuations of three prompts over 16 tokens equal transformers'; the first
prompt's last logits within TOLERANCE x their std (test_moe_qwen3.py's); every token's routing
decisions in every layer equal transformers' on the three prompts (no two experts tie there);
renormalizing the top-k (which OLMoE does not), or norming q and k per head (as Qwen3 does), moves
the logits by far more than the tolerance.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
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
from transformers import AutoConfig, OlmoeConfig

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.sources import gguf_config
from ifb.runtime.step.network import RMSNorm

NEW_TOKENS = 16
PROMPT_LENGTHS = (11, 20, 29)
# test_moe_qwen3.py's. Measured on the three prompts: dense fp32 and the F32 file 1.3-2.4e-6 x std,
# the Q8_0 file 1.6-3.0e-6 against the rounded oracle (0.07-0.21, and all three continuations
# changed, against the unrounded one)
TOLERANCE = 1e-4
# A wrong reading must move the logits by >= this many tolerances. Measured: renormalizing the
# top-k 0.27-0.56 x std (and all three transformers continuations change with it), norming q and
# k per head 0.76-2.1 x std
MARGIN = 300


def olmoe_config(**overrides: Any) -> OlmoeConfig:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,  # one expert's; a multiple of 32: the down projection's K takes Q8_0 blocks
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # k's norm (32 wide) differs from q's (64): both read at their width
        max_position_embeddings=512,
        rms_norm_eps=1e-5,  # llama.cpp's converter writes 1e-5 for every OLMoE
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return OlmoeConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = write_moe_folder(tmp_path_factory.mktemp("olmoe") / "hf", olmoe_config())
    return converted_sources(folder)


@pytest.fixture(scope="module")
def engines(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    get, built = engine_builder(sources, tmp_path_factory.mktemp("olmoe-engines"))
    yield get
    built.clear()


def test_the_spec_carries_the_experts_and_the_whole_width_norms(sources: dict[str, Path]) -> None:
    """From the folder and from llama.cpp's files alike (transformers' GGUF reader does not know
    `olmoe`: the family's key table reads it)."""
    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(sources["hf"]))
    assert (spec.architecture, spec.num_experts, spec.num_experts_per_tok) == ("olmoe", 8, 2)
    assert (spec.moe_intermediate_size, spec.norm_topk_prob) == (64, False)
    assert (spec.qk_norm, spec.qk_norm_across_heads) == (True, True)
    for outtype in ("f32", "q8_0"):
        from_file = model_spec_from_hf_config(gguf_config(sources[outtype]))
        assert from_file.rms_norm_eps == pytest.approx(spec.rms_norm_eps, rel=1e-6)  # stored as float32
        assert replace(from_file, rms_norm_eps=spec.rms_norm_eps) == spec


def test_clip_qkv_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match=r"olmoe clip_qkv=8.0 \(q, k and v clamped\) is not supported"):
        model_spec_from_hf_config(olmoe_config(clip_qkv=8.0))


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


def test_renormalizing_the_top_k_fails_the_check(sources: dict[str, Path], engines: Any) -> None:
    """The dense engine's own network, run eagerly with norm_topk_prob switched on, is as far from
    transformers as transformers with it: the tolerance above would catch an engine that did."""
    eager, blocks = eager_moe_engine(engines("dense-fp32"))
    text = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)[0]
    hf = oracle(sources["hf"])
    assert logit_error(eager, hf, text) <= TOLERANCE
    for block in blocks:
        block.norm_topk_prob = True
    moved = logit_error(eager, hf, text)
    assert moved >= MARGIN * TOLERANCE, f"renormalized top-k: logits move {moved:.2e} x std"
    assert logit_error(eager, oracle(sources["hf"], norm_topk_prob=True), text) <= TOLERANCE


class _PerHead(torch.nn.Module):
    """A whole-width RMSNorm's weight applied per head: each head's q (or k) normed on its own."""

    def __init__(self, norm: RMSNorm, heads: int) -> None:
        super().__init__()
        self.weight, self.eps, self.heads = norm.weight, norm.eps, heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [tokens, heads, head_dim]
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight.reshape(self.heads, -1)


def test_norming_q_and_k_per_head_fails_the_check(sources: dict[str, Path], engines: Any) -> None:
    """The dense engine's own network, run eagerly with the same norm weights applied head by head
    (Qwen3's q/k norm), is far from transformers: the tolerance catches a per-head reading."""
    eager, _ = eager_moe_engine(engines("dense-fp32"))
    text = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)[0]
    hf = oracle(sources["hf"])
    assert logit_error(eager, hf, text) <= TOLERANCE
    for layer in eager.backend.network.layers:  # type: ignore[attr-defined]
        attn = layer.attn
        attn.qk_norm_across_heads = False
        attn.q_norm, attn.k_norm = _PerHead(attn.q_norm, attn.num_heads), _PerHead(attn.k_norm, attn.num_kv_heads)
    moved = logit_error(eager, hf, text)
    assert moved >= MARGIN * TOLERANCE, f"per-head q/k norms: logits move {moved:.2e} x std"
