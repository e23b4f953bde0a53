"""Every family as llama.cpp's own converter writes it, read by the builder, against transformers
running the HF folder the file was converted from.

Input: a tiny trained-like HF checkpoint (tests/sharp_models.py: attention far from uniform, norms
not ones), converted by llama.cpp's convert_hf_to_gguf.py with its own gguf-py
(tests/llama_cpp_converter.py) to F32 and to Q8_0, and, where bench/peers.py has built llama.cpp's
llama-quantize, the F32 file through it to Q4_K_M (256-wide checkpoints, so the rows take K-quant
blocks; skipped, saying why, where it is not built). Oracle: `AutoModelForCausalLM.from_pretrained`
on the HF folder; the GGUF is never read through our code on the oracle's side, so a metadata key
or tensor the builder misreads cannot be misread the same way by both.

Checks, per family and file type: the engine's ModelSpec equals the one the folder's config gives
(but for what the file cannot say); greedy continuations of three prompts (11, 20 and 29 tokens,
past the 8-token windows) over 16 tokens equal transformers', the longest also prefilled in chunks;
the first prompt's last logits within TOLERANCE x their standard deviation across the vocabulary
(the logits' spread, ~4 here); a quantized file's blocks stay blocks. For a Q8_0 file the oracle's
2-D weights are first rounded as Q8_0 rounds them (gguf-py's quantize/dequantize, applied to the
HF folder's tensors, after checking the file stores every 2-D tensor as Q8_0): against the
unrounded folder, Q8_0 of these sharp q/k weights moves the last logits by 0.08-0.21 x std and
changed 2 of 3 Llama greedy continuations, which says nothing about the reader. For a Q4_K_M file
(a mix of Q4_K, Q6_K and fallbacks that gguf-py cannot all quantize) the oracle's 2-D weights are
the file's own tensors dequantized by gguf-py, q/k rows un-permuted as llama.cpp permutes them.

Each family's companion test shows the check can fail: transformers on the same folder with one
feature changed (RoPE theta x50, a norm's weights dropped, a soft-cap or window removed, RoPE
scaling removed) moves the last logits by at least MARGIN x TOLERANCE and changes a greedy
continuation, so a builder that misread that feature would fail here. Measured margins are in
FEATURES' comments.

Engines: the real builder reads the GGUF and writes the engine folder (weights, tokenizer,
engine.json); the step's AOT compile is skipped and the step runs eagerly (StepMode.EAGER, the same
network the compile traces). 30 compiles would cost ~15 minutes of `make test` on 2 cores;
IFB_CONFORMANCE_COMPILE=1 builds and runs the compiled step instead. The three block-quantized
files with windows (Gemma 2, Gemma 3, Phi-3) are also built compiled, once each: on them the
compiled step is pinned to the eager and reference ones, a prompt's logits are bitwise the same
alone, batched, chunked and after a reused prefix, and in-flight batching equals each request alone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from family_checks import assert_bitwise_invariant, assert_step_modes_agree, build_fp32, oracle, rounded_as
from greedy_loop import greedy_generate, hf_greedy, scattered_blocks
from llama_cpp_converter import convert_many
from sharp_models import VOCAB_SIZE, write_sharp_checkpoint
from step_cases import prompts
from tiny_models import TINY_LIMITS
from transformers import AutoConfig

from ifb.builder import build as builder_build
from ifb.builder.artifact_cache import ArtifactCache
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.compile_cpu import build_engine_kernels
from ifb.builder.compiled_step import CompiledStep
from ifb.builder.hf_config import model_spec_from_hf_config
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
    # Phi-4-mini's shape: LongRoPE over part of each head (rope.dimension_count 8 of head_dim 16,
    # so 4 factors), which transformers' own GGUF reader drops
    "phi3-longrope": Case(
        "phi3",
        dict(
            partial_rotary_factor=0.5,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                long_factor=[1.0 + 0.5 * i for i in range(4)],
                short_factor=[1.0 + 0.3 * i for i in range(4)],
                original_max_position_embeddings=64,
            ),
        ),
        ("scaling",),
        ("f32",),
    ),
    # llama.cpp's file has no key for query_pre_attn_scalar: its graph scales by head_dim**-0.5
    # (16 here), so these two, 24, are checked against transformers with the scalar set to 16
    # (test_llama_cpp_files_scale_gemma_attention_by_head_dim); the Gemma 3 one also has the
    # 4B-27B's linear RoPE scaling on its global layer (the file's rope.scaling.* keys).
    "gemma2-scalar": Case("gemma2", GEMMA2 | dict(query_pre_attn_scalar=24), (), ("f32",)),
    "gemma3-scalar": Case(
        "gemma3_text",
        dict(sliding_window=WINDOW, query_pre_attn_scalar=24, rope_scaling=dict(rope_type="linear", factor=8.0)),
        ("scaling",),
        ("f32",),
    ),
    # A window on every layer in a block-quantized file: llama.cpp writes one for Phi-3
    # (`phi3.attention.sliding_window`), never for Mistral; the compiled tests below run on it
    "phi3-window": Case("phi3", dict(sliding_window=WINDOW), ("window",), ("q8_0",)),
    # K-quant blocks are 256 weights of a row: these checkpoints' rows are 256 or 512 wide, so
    # llama-quantize's Q4_K_M writes Q4_K/Q6_K blocks, not its fallbacks for narrower rows
    "llama-wide": Case("llama", dict(hidden_size=256, intermediate_size=512), (), ("q4_k_m",)),
    "qwen3-wide": Case(
        "qwen3", dict(hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=True), (), ("q4_k_m",)
    ),
}
ENGINES = [(name, outtype) for name, case in CASES.items() for outtype in case.outtypes]
# these are checked against transformers with what the file cannot say changed (see their tests)
BY_THEIR_OWN_TEST = ("mistral-window", "gemma2-scalar", "gemma3-scalar")
CONFORMANCE = [(name, outtype) for name, outtype in ENGINES if name not in BY_THEIR_OWN_TEST]
# Block-quantized files with windows: the compiled engine's bitwise, step-mode and in-flight tests
WINDOWED_BLOCKS = ("gemma2-q8_0", "gemma3-q8_0", "phi3-window-q8_0")

# llama.cpp's quantizer (C++): built by bench/peers.py, never by a test
LLAMA_QUANTIZE = Path(__file__).resolve().parents[2] / "bench" / "out" / "llama.cpp" / "bin" / "llama-quantize"
NO_QUANTIZE = f"{LLAMA_QUANTIZE} is not built (bench/peers.py builds it): no Q4_K_M file to read"
# Max |ours - transformers| on a Q4_K_M file, x std, the oracle's 2-D weights the file's own
# dequantized (`dequantized_as`): measured 2.3e-6 (llama-wide) and 3.2e-6 (qwen3-wide), Q4_K + Q6_K.
# Against the unrounded folders the files are 0.82-0.85 x std off (Llama: 3 of 3 greedy continuations
# differ): the rounding, not the reader.
TOLERANCE_Q4_K_M = 1e-4
# Max |mode - compiled| between step modes of one engine, x std (fp32 sums in other orders)
MODES_TOLERANCE = 2.5e-5


def _case_param(name: str, outtype: str | None = None) -> Any:
    case = CASES[name]
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    if outtype == "q4_k_m":
        marks.append(pytest.mark.skipif(not LLAMA_QUANTIZE.is_file(), reason=NO_QUANTIZE))
    return pytest.param(name, *([outtype] if outtype else []), marks=marks, id=f"{name}-{outtype}" if outtype else name)


def _quantize(source: Path, out: Path, kind: str) -> Path:
    """`llama-quantize source out KIND`, llama.cpp's own quantizer."""
    done = subprocess.run([str(LLAMA_QUANTIZE), str(source), str(out), kind], capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case's HF folder, and its GGUFs as `{name}-{outtype}`: one converter process for all
    (a Q4_K_M file: the converter's F32 file through llama-quantize, where it is built)."""
    root = tmp_path_factory.mktemp("converter-conformance")
    paths: dict[str, Path] = {}
    for seed, (name, case) in enumerate(CASES.items()):
        paths[name] = write_sharp_checkpoint(root / name, case.family, seed=seed, **case.overrides)
    jobs, quantized = [], []
    for name, outtype in ENGINES:
        paths[f"{name}-{outtype}"] = root / f"{name}-{outtype}.gguf"
        if outtype == "q4_k_m":
            if LLAMA_QUANTIZE.is_file():
                jobs.append((paths[name], root / f"{name}-f32-for-quantize.gguf", "f32"))
                quantized.append((jobs[-1][1], paths[f"{name}-{outtype}"]))
        else:
            jobs.append((paths[name], paths[f"{name}-{outtype}"], outtype))
    convert_many(jobs)
    for source, out in quantized:
        _quantize(source, out, "Q4_K_M")
    return paths


def _uncompiled_step(
    backend: Any,
    recipe: Any,
    weights_path: Path,
    limits: Any,
    kv_dtype: str,
    folder: Path,
    reuse: bool = True,
    process: Any = None,
    chunking: Any = None,
) -> Any:
    """The compile phase without the AOT compile: the kernel library a block engine's eager step
    needs, and no step package (the engine runs StepMode.EAGER). With it goes `nullcontext` for
    `started_compile_process`: no compile process to start."""
    kernels = build_engine_kernels(folder, ArtifactCache(reuse=reuse))[0] if recipe.weight_formats else None
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
                    patch.setattr(builder_build, "started_compile_process", nullcontext)
                    patch.setattr(builder_build, "calibrate_engine_folder", lambda folder, build_info, **_: None)
                    build_engine(converted[key], root / key, options)
            built[key] = Engine.load(root / key, StepMode.COMPILED if COMPILE else StepMode.EAGER, verify=COMPILE)
        return built[key]

    yield get
    built.clear()


def dequantized_as(model: torch.nn.Module, gguf_path: Path) -> torch.nn.Module:
    """`model` with every 2-D weight replaced by the file's own tensor, dequantized by gguf-py
    (q/k rows un-permuted where llama.cpp's converter permutes them: Llama-shaped archs), so
    the oracle computes with exactly the weights the file holds, whatever block type each is."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(gguf_path)
    arch = str(reader.fields["general.architecture"].contents())
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    permuted = arch in ("llama", "smollm3")
    used = set()
    with torch.no_grad():
        for hf_name, param in model.named_parameters():
            if param.ndim != 2:
                continue
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert name in tensors, (hf_name, name)
            used.add(name)
            weights = dequantize(tensors[name].data, tensors[name].tensor_type).reshape(param.shape)
            if permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
                rows = weights.shape[0]  # llama.cpp's permute, undone: (heads, 2, half) -> (heads, half, 2)
                weights = weights.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(param.shape)
            param.copy_(torch.from_numpy(weights.copy()))
    unused = {n for n, t in tensors.items() if len(t.shape) == 2 and n not in used}
    assert not unused, f"{gguf_path.name}: 2-D tensors no parameter took: {sorted(unused)}"
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


def reference(name: str, outtype: str, converted: dict[str, Path]) -> torch.nn.Module:
    """transformers on the HF folder, its 2-D weights rounded as the file holds them."""
    hf = oracle(converted[name])
    if outtype == "q8_0":
        return rounded_as(hf, converted[f"{name}-{outtype}"])
    if outtype == "q4_k_m":
        return dequantized_as(hf, converted[f"{name}-{outtype}"])
    return hf


def spread(hf: torch.nn.Module) -> float:
    """The std of transformers' last logits for the first prompt (the tolerances' unit)."""
    return last_logits(hf, conformance_prompts()[0]).std().item()


@pytest.mark.parametrize(("name", "outtype"), [_case_param(name, outtype) for name, outtype in CONFORMANCE])
def test_engine_from_llama_cpp_file_matches_transformers_on_the_hf_folder(
    name: str, outtype: str, converted: dict[str, Path], engines: Any
) -> None:
    """Greedy tokens equal over 16 tokens for three prompts (the longest also prefilled in
    chunks of 3 and WINDOW + 1, cutting windows and blocks); last logits within the tolerance.
    A quantized file's blocks stay blocks (no dequantized copy in the engine)."""
    hf = reference(name, outtype, converted)
    engine = engines(name, outtype)
    formats = engine.config.weight_formats
    if outtype == "q8_0":
        assert engine.config.kernels is not None and "embed" in formats and set(formats.values()) == {"q8_0"}
    if outtype == "q4_k_m":  # llama-quantize's mix: Q4_K and Q6_K on these 256-wide rows
        assert {"q4_k", "q6_k"} <= set(formats.values()), formats
    texts = conformance_prompts()
    theirs = last_logits(hf, texts[0])
    error = (engine_last_logits(engine, texts[0]) - theirs).abs().max().item() / theirs.std().item()
    tolerance = TOLERANCE_Q4_K_M if outtype == "q4_k_m" else TOLERANCE
    assert error <= tolerance, f"{name} {outtype}: max logit error {error:.2e} x std"
    for text in texts:
        expected = hf_greedy(hf, text, NEW_TOKENS)
        assert greedy_generate(engine, text, NEW_TOKENS) == expected, (name, outtype, len(text))
    longest = texts[-1]
    for chunk in (3, WINDOW + 1):
        assert greedy_generate(engine, longest, NEW_TOKENS, chunk=chunk) == expected, (name, outtype, chunk)


# What llama.cpp's file cannot say, so the spec read from it differs from the folder's by design
SPEC_FROM_FILE = {
    "mistral": dict(architecture="llama"),  # written as arch `llama`, run as Llama by llama.cpp
    "mistral-window": dict(architecture="llama", sliding_window=None),  # no window key (see below)
    "gemma2-scalar": dict(attention_scale=16**-0.5),  # no query_pre_attn_scalar key: head_dim's
    "gemma3-scalar": dict(attention_scale=16**-0.5),
}


@pytest.mark.parametrize(("name", "outtype"), [_case_param(name, outtype) for name, outtype in ENGINES])
def test_the_spec_read_from_the_file_is_the_folders(
    name: str, outtype: str, converted: dict[str, Path], engines: Any
) -> None:
    """The engine's ModelSpec from llama.cpp's file equals the one transformers' config of the
    folder gives (head_dim from key_length, q/k norms, biases, NoPE layers, windows, soft-caps,
    partial rotary...), but for what the file cannot say (SPEC_FROM_FILE) and rms_norm_eps,
    stored as f32."""
    folder = model_spec_from_hf_config(AutoConfig.from_pretrained(converted[name])).to_json()
    ours = engines(name, outtype).config.spec.to_json()
    assert ours.pop("rms_norm_eps") == pytest.approx(folder.pop("rms_norm_eps"), rel=1e-6)
    assert ours == folder | SPEC_FROM_FILE.get(name, {})


def without(feature: str, folder: Path) -> torch.nn.Module:
    """transformers on `folder` with `feature` taken away."""
    config = AutoConfig.from_pretrained(folder)
    if feature == "rope_theta":  # a theta misread (x50)
        rope = dict(config.rope_parameters)
        nested = "full_attention" in rope
        for params in rope.values() if nested else [rope]:
            params["rope_theta"] = params["rope_theta"] * 50
        return oracle(folder, rope_parameters=rope)
    if feature == "scaling" and "full_attention" in config.rope_parameters:  # Gemma 3's global layers
        full = config.rope_parameters["full_attention"]
        rope = {**config.rope_parameters, "full_attention": {"rope_type": "default", "rope_theta": full["rope_theta"]}}
        return oracle(folder, rope_parameters=rope)
    if feature == "scaling":  # the file's RoPE scaling not applied: plain RoPE, same theta
        rope = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
        if config.model_type == "phi3":  # the rotary part of each head stays what it is
            rope["partial_rotary_factor"] = config.rope_parameters.get("partial_rotary_factor", 1.0)
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


@pytest.fixture(scope="module")
def compiled(converted: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`compiled(key)`: the folder of the engine built, AOT compile included, from that GGUF."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("conformance-compiled")

    def get(key: str) -> Path:
        if key not in built:
            built[key] = build_fp32(converted[key], root / key)
        return built[key]

    yield get
    built.clear()


@pytest.mark.parametrize("key", WINDOWED_BLOCKS)
def test_windowed_block_engine_logits_are_bitwise_batch_chunk_and_prefix_invariant(
    key: str, converted: dict[str, Path], compiled: Any
) -> None:
    """On the compiled engine of a Q8_0 file with windows (the decode kernel's windowed path;
    Gemma 2's soft-capped one, Gemma 3's local and global layers, Phi-3's window on every layer),
    a prompt's last logits, bit for bit: alone; beside other prompts and a decode deep past the
    window; prefilled in two chunks split around window edges; after a reused prefix. Alone,
    they are transformers' on the rounded folder within TOLERANCE x std (so a window ignored
    everywhere alike fails too)."""
    hf = reference(key.removesuffix("-q8_0"), "q8_0", converted)
    engine = Engine.load(compiled(key), StepMode.COMPILED)
    assert_bitwise_invariant(engine, hf, WINDOW, atol=TOLERANCE * spread(hf))


@pytest.mark.parametrize("key", WINDOWED_BLOCKS)
def test_compiled_eager_and_reference_paths_agree_past_the_window(
    key: str, converted: dict[str, Path], compiled: Any
) -> None:
    """One mixed step (a chunk past the window over cached context, a whole prompt, a deep
    decode) in the three step modes of the compiled engine: the reference loops, the torch
    masks and the kernels agree, and the reference's logits are transformers'."""
    hf = reference(key.removesuffix("-q8_0"), "q8_0", converted)
    # reference loops vs compiled: measured 2.2e-5 absolute = 5.3e-6 x std on phi3-window
    assert_step_modes_agree(compiled(key), hf, atol=TOLERANCE * spread(hf), modes_atol=MODES_TOLERANCE * spread(hf))


@pytest.mark.parametrize("settings", [{}, {"max_num_tokens": 16}], ids=["whole_prompts", "chunked_16"])
def test_in_flight_batching_with_prefix_reuse_past_the_window_equals_alone(
    settings: dict[str, int], converted: dict[str, Path], compiled: Any
) -> None:
    """On the compiled Phi-3 Q8_0 engine (a window of 8 on every layer): 32 requests arriving
    over time (prompts to 72 tokens, many sharing a 16- or 32-token prefix, so reused blocks and
    chunk edges fall mid-window) through the scheduler and the prefix cache: every output equals
    its request run alone, and the four longest alone equal transformers (so a window ignored
    everywhere alike fails here too)."""
    from test_runtime import run_arriving_over_time, workload

    from ifb import LLM

    folder = compiled("phi3-window-q8_0")
    items = workload(5)
    engine = Engine.load(folder, StepMode.COMPILED)
    alone = {i: greedy_generate(engine, prompt, n) for i, (prompt, n) in enumerate(items)}
    hf = reference("phi3-window", "q8_0", converted)
    longest = sorted(range(len(items)), key=lambda i: len(items[i][0]) + items[i][1])[-4:]
    assert all(alone[i] == hf_greedy(hf, items[i][0], items[i][1]) for i in longest)
    with LLM(folder, **settings) as llm:
        results = run_arriving_over_time(llm, items, seed=9)
        stats = llm.stats()
        llm.executor.scheduler.check_integrity()
    assert results == alone
    assert stats.kv.prefix_cache_hit_tokens > 0


@pytest.mark.parametrize("name", ["gemma2-scalar", "gemma3-scalar"])
def test_llama_cpp_files_scale_gemma_attention_by_head_dim(name: str, converted: dict[str, Path], engines: Any) -> None:
    """llama.cpp's converter writes no query_pre_attn_scalar (24 in these folders), and its graph
    scales scores by head_dim**-0.5, so the engine from its file runs as transformers does with
    the scalar set to head_dim (16): greedy equal, last logits within the tolerance (the
    folder's own 24 moves them far past it: the spec test pins the scale read)."""
    engine, hf = engines(name, "f32"), oracle(converted[name], query_pre_attn_scalar=16)
    texts = conformance_prompts()
    theirs = last_logits(hf, texts[0])
    error = (engine_last_logits(engine, texts[0]) - theirs).abs().max().item() / theirs.std().item()
    assert error <= TOLERANCE, f"{name}: max logit error {error:.2e} x std"
    for text in texts:
        assert greedy_generate(engine, text, NEW_TOKENS) == hf_greedy(hf, text, NEW_TOKENS), len(text)
