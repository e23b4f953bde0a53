"""Qwen3-MoE (Qwen3-30B-A3B's architecture) from an HF folder, built by `ifb build`, against
transformers' Qwen3MoeForCausalLM on the same folder.

Input: a tiny seeded Qwen3MoeForCausalLM (8 experts, 2 per token, norm_topk_prob, every layer MoE,
no shared expert) with trained-like scales (tests/sharp_models.py's `sharpen`: attention far from
uniform) and a router twice as sharp, saved by transformers (per-expert tensors, as the released
checkpoints). Engines, each compiled (AOTInductor, the grouped-experts op called through its C
shim): dense fp32 experts (`--weights auto`, the only compute mode dense weights have), and
`--weights q8_0` in both compute modes (`--compute fp32`, `--compute int8`). For Q8_0 the oracle's
2-D and expert weights are first rounded through Q8_0 as gguf-py rounds them (the router and the
embedding stay fp32, as the builder keeps them).

Checks: greedy continuations of three prompts over 16 tokens equal transformers'; the first
prompt's last logits within TOLERANCE x their std (measured: see the constants). `--compute
int8` quantizes every activation to int8 per 32 (as llama.cpp does), which is not transformers'
arithmetic: there the logits stay within TOLERANCE_INT8 and greedy output mostly agrees. A prompt's
logits bitwise the same alone and batched beside others that route to other experts; ignoring
norm_topk_prob moves transformers' logits by far more than the tolerance and changes greedy
output, so the engine could not pass while ignoring it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from family_checks import last_logits
from greedy_loop import greedy_generate, hf_greedy, scattered_blocks
from sharp_models import VOCAB_SIZE, sharpen, write_spm_tokenizer
from step_cases import prompts
from tiny_models import TINY_LIMITS
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

from ifb.builder import build as builder_build
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.errors import UnsupportedModelError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.runtime.step.backend import NetworkStep, StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.moe_block import MoeBlock
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

NEW_TOKENS = 16
PROMPT_LENGTHS = (11, 20, 29)
# Max |engine - transformers| of the last logits, x their std. Measured on the three prompts:
# dense fp32 2.4-4.2e-6, Q8_0 with fp32 compute 1.8-3.7e-6 (fp32 sums in other orders); Q8_0 with
# int8 compute 0.08-0.37 (int8 activations; a router input moved that far can flip an expert),
# its greedy output agreeing with transformers' for 12, 16 and 16 tokens.
TOLERANCE = 1e-4
TOLERANCE_INT8 = 0.5
INT8_AGREED_TOKENS = 8  # every prompt's first tokens, and 2 of 3 prompts over all 16
# Ignoring norm_topk_prob must move the logits by >= this many tolerances (measured: see the test)
MARGIN = 300
# name -> (--weights, --compute)
ENGINES = {"dense-fp32": ("auto", "fp32"), "q8_0-fp32": ("q8_0", "fp32"), "q8_0-int8": ("q8_0", "int8")}


def moe_config(**overrides: Any) -> Qwen3MoeConfig:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,  # the dense MLP's (unused: every layer is MoE)
        moe_intermediate_size=64,  # a multiple of 32: the down projection's K takes Q8_0 blocks
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    return Qwen3MoeConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-moe") / "hf"
    config = moe_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sharpen(model, config, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # router logits std ~2: decisive, few near-ties
                param.mul_(2.0)
    model.save_pretrained(path)
    write_spm_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def engines(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`engines(name)`: the compiled engine ENGINES[name] describes, built once per module."""
    built: dict[str, Engine] = {}
    root = tmp_path_factory.mktemp("qwen3-moe-engines")

    def get(name: str) -> Engine:
        if name not in built:
            weights, compute = ENGINES[name]
            options = BuildOptions(dtype="fp32", weights=weights, compute=compute, **TINY_LIMITS)
            with pytest.MonkeyPatch.context() as patch:  # the step cost calibration is not under test
                patch.setattr(builder_build, "calibrate_engine_folder", lambda folder, build_info, **_: None)
                build_engine(folder, root / name, options)
            built[name] = Engine.load(root / name, StepMode.COMPILED)
        return built[name]

    yield get
    built.clear()


def oracle(folder: Path, **overrides: Any) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(folder)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def rounded_q8_0(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight `--weights q8_0` quantizes (attention, head, experts; not the router or the
    embedding) rounded through Q8_0 along its rows as gguf-py rounds them."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim < 2 or name.endswith(("embed_tokens.weight", "mlp.gate.weight")):
                continue
            rows = param.numpy().astype(np.float32).reshape(-1, param.shape[-1])
            param.copy_(torch.from_numpy(dequantize(quantize(rows, q8), q8).reshape(param.shape)))
    return model


def reference(name: str, folder: Path) -> torch.nn.Module:
    hf = oracle(folder)
    return rounded_q8_0(hf) if name.startswith("q8_0") else hf


def engine_last_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    table = scattered_blocks(engine, len(token_ids))
    inputs = build_step_inputs([RequestSlice(token_ids, 0, table, sample=True)], engine.config.limits.block_size)
    return engine.step(inputs)[0]


def hf_last_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1]


def test_the_spec_carries_the_experts(folder: Path) -> None:
    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(folder))
    assert (spec.architecture, spec.num_experts, spec.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert (spec.moe_intermediate_size, spec.norm_topk_prob, spec.qk_norm) == (64, True, True)


@pytest.mark.parametrize(
    "overrides",
    [dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)],
    ids=["mlp_only_layers", "decoder_sparse_step"],
)
def test_dense_layers_among_the_experts_are_refused_by_name(overrides: dict[str, Any]) -> None:
    key = next(iter(overrides))
    with pytest.raises(UnsupportedModelError, match=f"qwen3_moe with dense MLP layers.*{key}"):
        model_spec_from_hf_config(moe_config(**overrides))


def check_formats(name: str, engine: Engine) -> None:
    formats = set(engine.config.weight_formats.values())
    assert formats == ({"fp32"} if name.startswith("dense") else {"q8_0"}), formats
    assert engine.config.kernels is not None  # the grouped op is the engine's own library's


def logit_error(engine: Engine, hf: torch.nn.Module, text: list[int]) -> float:
    theirs = hf_last_logits(hf, text)
    return (engine_last_logits(engine, text) - theirs).abs().max().item() / theirs.std().item()


@pytest.mark.parametrize("name", ["dense-fp32", "q8_0-fp32"])
def test_engine_matches_transformers_on_the_hf_folder(name: str, folder: Path, engines: Any) -> None:
    """Greedy tokens equal over 16 tokens for three prompts (the longest also prefilled in chunks
    of 5); the first prompt's last logits within the tolerance x std."""
    hf = reference(name, folder)
    engine = engines(name)
    check_formats(name, engine)
    texts = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)
    error = logit_error(engine, hf, texts[0])
    assert error <= TOLERANCE, f"{name}: max logit error {error:.2e} x std"
    for text in texts:
        expected = hf_greedy(hf, text, NEW_TOKENS)
        assert greedy_generate(engine, text, NEW_TOKENS) == expected, (name, len(text))
    assert greedy_generate(engine, texts[-1], NEW_TOKENS, chunk=5) == expected, name


def test_int8_compute_stays_close_to_transformers(folder: Path, engines: Any) -> None:
    """Q8_0 weights with int8 activations: logits within TOLERANCE_INT8 x std on every prompt,
    greedy output equal over the first INT8_AGREED_TOKENS tokens of each and all 16 of two."""
    hf, engine = reference("q8_0-int8", folder), engines("q8_0-int8")
    check_formats("q8_0-int8", engine)
    assert engine.config.weight_compute == "int8"
    texts = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)
    errors = [logit_error(engine, hf, text) for text in texts]
    assert max(errors) <= TOLERANCE_INT8, errors
    outputs = [(greedy_generate(engine, text, NEW_TOKENS), hf_greedy(hf, text, NEW_TOKENS)) for text in texts]
    assert all(ours[:INT8_AGREED_TOKENS] == theirs[:INT8_AGREED_TOKENS] for ours, theirs in outputs), outputs
    assert sum(ours == theirs for ours, theirs in outputs) >= 2, outputs


@pytest.mark.parametrize("name", ["q8_0-fp32", "q8_0-int8"])
def test_a_prompts_logits_are_bitwise_the_same_alone_and_batched(name: str, engines: Any) -> None:
    """Three prompts whose tokens route to different experts: each one's last logits alone equal,
    bit for bit, its logits in one step beside the other two (in reverse order). Block engines
    only, as for dense families: a dense engine's attention linears are MKL's GEMMs, which make no
    such promise (the grouped op's dense path does: tests/unit/test_grouped_experts.py)."""
    engine = engines(name)
    texts = prompts(VOCAB_SIZE, [23, 9, 31], seed=5)
    tables = [[3, 17], [9], [41, 1]]
    slices = [RequestSlice(text, 0, table, True) for text, table in zip(texts, tables, strict=True)]
    alone = [last_logits(engine, [[piece]])[0] for piece in slices]
    batched = last_logits(engine, [slices[::-1]])
    for row in range(3):
        assert torch.equal(batched[2 - row], alone[row]), (name, row)


def test_ignoring_norm_topk_prob_bites(folder: Path) -> None:
    """transformers without the top-k renormalization moves the last logits by >= MARGIN
    tolerances (measured 0.16, 0.35 and 0.78 x std on the three prompts: 1,600-7,800 tolerances)
    and changes greedy continuations (all three, first at tokens 4, 5 and 0): an engine that
    ignored norm_topk_prob would fail the test above."""
    texts = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)
    reference_model, changed = oracle(folder), oracle(folder, norm_topk_prob=False)
    theirs = hf_last_logits(reference_model, texts[0])
    moved = (hf_last_logits(changed, texts[0]) - theirs).abs().max().item() / theirs.std().item()
    assert moved >= MARGIN * TOLERANCE, f"without norm_topk_prob: logits move {moved:.2e} x std"
    changed_texts = [t for t in texts if hf_greedy(changed, t, NEW_TOKENS) != hf_greedy(reference_model, t, NEW_TOKENS)]
    assert changed_texts, "no greedy continuation changed"


def test_the_engine_ignoring_norm_topk_prob_fails_the_check(folder: Path, engines: Any) -> None:
    """The dense engine's own network run eagerly with the renormalization switched off is as far
    from transformers as transformers without it: the tolerance above catches it."""
    engine = engines("dense-fp32")
    eager = Engine.load(engine.config.folder, StepMode.EAGER)
    assert isinstance(eager.backend, NetworkStep)
    text = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)[0]
    hf = oracle(folder)
    assert logit_error(eager, hf, text) <= TOLERANCE
    for layer in eager.backend.network.layers:
        assert isinstance(layer.mlp, MoeBlock)
        layer.mlp.norm_topk_prob = False
    assert logit_error(eager, hf, text) >= MARGIN * TOLERANCE
