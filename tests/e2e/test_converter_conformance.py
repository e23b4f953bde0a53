"""Every family as llama.cpp's own converter writes it, read by the builder, against transformers
running the HF folder the file was converted from.

Input: a tiny trained-like HF checkpoint (tests/sharp_models.py: attention far from uniform, norms
not ones), converted by llama.cpp's convert_hf_to_gguf.py with its own gguf-py
(tests/llama_cpp_converter.py) to F32 and to Q8_0. Oracle: `AutoModelForCausalLM.from_pretrained`
on the HF folder; the GGUF is never read through our code on the oracle's side, so a metadata key
or tensor the builder misreads cannot be misread the same way by both.

Checks, per family and file type: greedy continuations of three prompts (11, 20 and 29 tokens,
past the 8-token windows) over 16 tokens equal transformers'; the first prompt's last logits within
TOLERANCE x their standard deviation across the vocabulary (the logits' spread, ~4 here). For a Q8_0
file the oracle's 2-D weights are first rounded as Q8_0 rounds them (gguf-py's quantize/dequantize,
applied to the HF folder's tensors, after checking the file stores every 2-D tensor as Q8_0):
against the unrounded folder, Q8_0 of these sharp q/k weights moves the last logits by 0.08-0.21 x
std and changed 2 of 3 Llama greedy continuations, which says nothing about the reader.

Each family's companion test shows the check can fail: transformers on the same folder with one
feature changed (RoPE theta x50, a norm's weights dropped, a soft-cap or window removed, RoPE
scaling removed) moves the last logits by at least MARGIN x TOLERANCE and changes a greedy
continuation, so a builder that misread that feature would fail here. Measured margins are in
FEATURES' comments.

Engines: the real builder reads the GGUF and writes the engine folder (weights, tokenizer,
engine.json); the step's AOT compile is skipped and the step runs eagerly (StepMode.EAGER, the same
network the compile traces: family tests pin compiled == eager). 22 compiles cost ~10 minutes of
`make test` on 2 cores; IFB_CONFORMANCE_COMPILE=1 builds and runs the compiled step instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_loop import greedy_generate, hf_greedy, scattered_blocks
from llama_cpp_converter import convert_many
from sharp_models import VOCAB_SIZE, write_sharp_checkpoint
from step_cases import prompts
from tiny_models import TINY_LIMITS
from transformers import AutoConfig, AutoModelForCausalLM

from ifb.builder import build as builder_build
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.compile_cpu import build_engine_kernels
from ifb.builder.compiled_step import CompiledStep
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

COMPILE = os.environ.get("IFB_CONFORMANCE_COMPILE") == "1"
OUTTYPES = ("f32", "q8_0")
# Max |ours - transformers| of the last logits, as a fraction of transformers' logits' std:
# measured 1.1-1.6e-6 on F32 files, 2.5-4.1e-6 on Q8_0 ones (Llama, tied and untied).
TOLERANCE = 1e-4
# A removed feature moves the logits by >= MARGIN tolerances: measured 0.039-3.4 x std, i.e.
# 390-34,000 tolerances (llama rope_theta 2.8, input_norm 1.9; llama-tied final_norm 0.60;
# qwen2 q_bias 2.6, ffn_norm 0.93; qwen3 qk_norm 3.4; smollm3 nope_layers 0.75; phi3 rope_theta
# 0.69; llama3 scaling 0.95, linear 3.4, yarn 1.5, longrope 0.67; mistral window 1.0; gemma2
# final_softcap 0.039, the smallest).
MARGIN = 300
PROMPT_LENGTHS = (11, 20, 29)
NEW_TOKENS = 16


@dataclass(frozen=True, slots=True)
class Case:
    """One checkpoint: a tiny_models family name, its config overrides, and the features whose
    removal the companion test measures (name -> config overrides or a state edit)."""

    family: str
    overrides: dict[str, Any] = field(default_factory=dict)
    features: tuple[str, ...] = ("rope_theta",)
    outtypes: tuple[str, ...] = OUTTYPES
    xfail: str | None = None


WINDOW = 8  # tokens; the prompts are longer, so a window read wrong changes the logits
GEMMA2 = dict(
    sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=10.0, final_logit_softcapping=10.0
)
CASES = {
    "llama": Case("llama", features=("rope_theta", "input_norm")),
    "llama-tied": Case("llama", dict(tie_word_embeddings=True), ("rope_theta", "final_norm")),
    # llama.cpp's converter writes no window for MistralForCausalLM (arch `llama`): see the test below
    "mistral": Case("mistral", features=("rope_theta", "input_norm")),
    "mistral-window": Case("mistral", dict(sliding_window=WINDOW), ("window",), ("f32",)),
    "qwen2-biases": Case("qwen2", dict(tie_word_embeddings=True), ("rope_theta", "q_bias")),
    "qwen2-untied": Case("qwen2", features=("rope_theta", "ffn_norm"), outtypes=("f32",)),
    "qwen3": Case("qwen3", dict(tie_word_embeddings=True), ("rope_theta", "qk_norm")),
    # llama.cpp's file has no key for SmolLM3's NoPE layers: its graph leaves RoPE out of every 4th
    # (SmolLM3Config's default), so the checkpoint has 4 layers in that pattern, not tiny_models'
    # 2-layer [1, 0], which no GGUF can say.
    "smollm3": Case("smollm3", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]), ("rope_theta", "nope_layers")),
    "phi3": Case("phi3", features=("rope_theta", "input_norm")),
    "gemma2": Case("gemma2", GEMMA2, ("rope_theta", "attn_softcap", "final_softcap", "window")),
    "gemma3": Case(
        "gemma3_text", dict(sliding_window=WINDOW, query_pre_attn_scalar=16), ("rope_theta", "qk_norm", "window")
    ),
    # RoPE scaling, each as the family ships it; originals small so the scaled frequencies bite at
    # these lengths. F32 only (the scaling is metadata or a small F32 tensor in either file type).
    "llama-llama3": Case(
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
        ("scaling",),
        ("f32",),
    ),
    "llama-linear": Case(
        "llama",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
        ("scaling",),
        ("f32",),
    ),
    "qwen3-yarn": Case(
        "qwen3",
        dict(
            tie_word_embeddings=True,
            max_position_embeddings=256,  # = factor x original, as transformers expects
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
        ),
        ("scaling",),
        ("f32",),
    ),
    "phi3-longrope": Case(
        "phi3",
        dict(
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                long_factor=[1.0 + 0.5 * i for i in range(8)],
                short_factor=[1.0 + 0.3 * i for i in range(8)],
                original_max_position_embeddings=64,
            )
        ),
        ("scaling",),
        ("f32",),
    ),
}
ENGINES = [(name, outtype) for name, case in CASES.items() for outtype in case.outtypes]
# the window case is checked against transformers without its window (see its test)
CONFORMANCE = [(name, outtype) for name, outtype in ENGINES if name != "mistral-window"]


def _case_param(name: str, outtype: str | None = None) -> Any:
    case = CASES[name]
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(name, *([outtype] if outtype else []), marks=marks, id=f"{name}-{outtype}" if outtype else name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case's HF folder, and its GGUFs as `{name}-{outtype}`: one converter process for all."""
    root = tmp_path_factory.mktemp("converter-conformance")
    paths: dict[str, Path] = {}
    for seed, (name, case) in enumerate(CASES.items()):
        paths[name] = write_sharp_checkpoint(root / name, case.family, seed=seed, **case.overrides)
    jobs = [(paths[name], root / f"{name}-{outtype}.gguf", outtype) for name, outtype in ENGINES]
    for (name, outtype), (_, out, _) in zip(ENGINES, jobs, strict=True):
        paths[f"{name}-{outtype}"] = out
    convert_many(jobs)
    return paths


def _uncompiled_step(backend: Any, recipe: Any, weights_path: Path, limits: Any, kv_dtype: str, folder: Path) -> Any:
    """The compile phase without the AOT compile: the kernel library a block engine's eager step
    needs, and no step package (the engine runs StepMode.EAGER)."""
    kernels = build_engine_kernels(folder) if recipe.weight_formats else None
    return CompiledStep("step.pt2", kernels=kernels, constants_external=bool(recipe.weight_formats)), 0


@pytest.fixture(scope="module")
def engines(converted: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`engines(name, outtype)`: the engine built from that GGUF, built once per module."""
    built: dict[str, Engine] = {}
    root = tmp_path_factory.mktemp("conformance-engines")

    def get(name: str, outtype: str) -> Engine:
        key = f"{name}-{outtype}"
        if key not in built:
            options = BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS)
            if COMPILE:
                build_engine(converted[key], root / key, options)
            else:
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(builder_build, "compile_in_child_process", _uncompiled_step)
                    patch.setattr(builder_build, "calibrate_engine_folder", lambda folder, build_info: None)
                    build_engine(converted[key], root / key, options)
            built[key] = Engine.load(root / key, StepMode.COMPILED if COMPILE else StepMode.EAGER, verify=COMPILE)
        return built[key]

    yield get
    built.clear()


def oracle(folder: Path, **config_overrides: Any) -> torch.nn.Module:
    """transformers on the HF folder (optionally with its config changed), fp32, eval."""
    config = AutoConfig.from_pretrained(folder)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def rounded_as(model: torch.nn.Module, gguf_path: Path) -> torch.nn.Module:
    """`model` with every 2-D weight rounded through Q8_0 as gguf-py rounds it, after checking
    that the file at `gguf_path` stores every 2-D tensor as Q8_0 (so these are its roundings)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize, quantize

    q8 = GGMLQuantizationType.Q8_0
    kinds = {t.name: t.tensor_type for t in GGUFReader(gguf_path).tensors if len(t.shape) == 2}
    assert kinds and all(kind == q8 for kind in kinds.values()), kinds
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                weights = param.numpy().astype(np.float32)
                param.copy_(torch.from_numpy(dequantize(quantize(weights, q8), q8).reshape(weights.shape)))
    return model


def last_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1]


def engine_last_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    table = scattered_blocks(engine, len(token_ids))
    inputs = build_step_inputs([RequestSlice(token_ids, 0, table, sample=True)], engine.config.limits.block_size)
    return engine.step(inputs)[0]


def conformance_prompts() -> list[list[int]]:
    return prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)


@pytest.mark.parametrize(("name", "outtype"), [_case_param(name, outtype) for name, outtype in CONFORMANCE])
def test_engine_from_llama_cpp_file_matches_transformers_on_the_hf_folder(
    name: str, outtype: str, converted: dict[str, Path], engines: Any
) -> None:
    """Greedy tokens equal over 16 tokens for three prompts; last logits within the tolerance."""
    hf = oracle(converted[name])
    if outtype == "q8_0":
        hf = rounded_as(hf, converted[f"{name}-{outtype}"])
    engine = engines(name, outtype)
    texts = conformance_prompts()
    theirs = last_logits(hf, texts[0])
    error = (engine_last_logits(engine, texts[0]) - theirs).abs().max().item() / theirs.std().item()
    assert error <= TOLERANCE, f"{name} {outtype}: max logit error {error:.2e} x std"
    for text in texts:
        assert greedy_generate(engine, text, NEW_TOKENS) == hf_greedy(hf, text, NEW_TOKENS), (name, outtype, len(text))


def without(feature: str, folder: Path) -> torch.nn.Module:
    """transformers on `folder` with `feature` taken away."""
    config = AutoConfig.from_pretrained(folder)
    if feature == "rope_theta":  # a theta misread (x50)
        rope = dict(config.rope_parameters)
        nested = "full_attention" in rope
        for params in rope.values() if nested else [rope]:
            params["rope_theta"] = params["rope_theta"] * 50
        return oracle(folder, rope_parameters=rope)
    if feature == "scaling":  # the file's RoPE scaling not applied: plain RoPE, same theta
        rope = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
        if config.model_type == "phi3":
            rope["partial_rotary_factor"] = 1.0
        return oracle(folder, rope_parameters=rope)
    if feature.endswith("softcap"):
        return oracle(folder, **{f"{feature.removesuffix('_softcap')}_logit_softcapping": None})
    if feature == "window":
        return oracle(folder, sliding_window=10_000)
    if feature == "nope_layers":  # RoPE on every layer
        return oracle(folder, no_rope_layers=[1] * config.num_hidden_layers)
    model = oracle(folder)
    suffix = {
        "input_norm": "input_layernorm.weight",
        "ffn_norm": "post_attention_layernorm.weight",
        "final_norm": "model.norm.weight",
        "qk_norm": ("q_norm.weight", "k_norm.weight"),
        "q_bias": "q_proj.bias",
    }[feature]
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(suffix):  # a norm's weight dropped (ones; Gemma stores 1 + w), a bias zeroed
                param.fill_(1.0 if feature.endswith("norm") and not gemma else 0.0)
    return model


@pytest.mark.parametrize(
    ("name", "feature"), [(name, feature) for name, case in CASES.items() for feature in case.features]
)
def test_each_feature_bites(name: str, feature: str, converted: dict[str, Path]) -> None:
    """Taking `feature` away moves transformers' last logits by >= MARGIN F32 tolerances and
    changes a greedy continuation: the conformance test above fails for a builder that drops it."""
    folder = converted[name]
    texts = conformance_prompts()
    reference, changed = oracle(folder), without(feature, folder)
    theirs = last_logits(reference, texts[0])
    moved = (last_logits(changed, texts[0]) - theirs).abs().max().item() / theirs.std().item()
    assert moved >= MARGIN * TOLERANCE, f"{name} without {feature}: logits move {moved:.2e} x std"
    if feature == "final_softcap":  # tanh is monotonic: the logits move, the argmax cannot
        return
    assert any(hf_greedy(changed, t, NEW_TOKENS) != hf_greedy(reference, t, NEW_TOKENS) for t in texts), feature


def test_llama_cpp_writes_no_window_for_mistral(converted: dict[str, Path], engines: Any) -> None:
    """llama.cpp's converter writes MistralForCausalLM as arch `llama` with no sliding_window key
    (its runtime attends to the whole context too), so an engine from its file runs without the
    window: transformers' greedy tokens with `sliding_window=None`, not the folder's (which differ:
    test_each_feature_bites[mistral-window-window]). Not an ifb defect: the file cannot say."""
    from gguf import GGUFReader

    keys = GGUFReader(converted["mistral-window-f32"]).fields
    assert "llama.attention.sliding_window" not in keys and "general.architecture" in keys
    engine, full = engines("mistral-window", "f32"), oracle(converted["mistral-window"], sliding_window=None)
    for text in conformance_prompts():
        assert greedy_generate(engine, text, NEW_TOKENS) == hf_greedy(full, text, NEW_TOKENS), len(text)
