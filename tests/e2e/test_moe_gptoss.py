"""gpt-oss (gpt-oss-20b's architecture) from an HF folder and from llama.cpp's F32 and Q8_0 files
of it, built by `ifb build`, against transformers' GptOssForCausalLM on the HF folder.

Input: a tiny seeded GptOssForCausalLM (8 experts, 2 per token, sliding window 8 on the even
layers, YaRN with truncate false as released) with trained-like scales (tests/sharp_models.py), a
router twice as sharp with an O(1) bias, O(1) expert biases, expert gate/up weights wide enough
that the SwiGLU clamp at 7 acts (GATE_UP_STD), and random sinks; saved by transformers (stacked,
interleaved `mlp.experts.gate_up_proj`). Engines, each compiled: dense fp32 experts from the
folder, and llama.cpp's converter's F32 and Q8_0 files (arch `gpt-oss`: `attn_sinks`,
`ffn_gate_inp` with a bias, split and transposed `ffn_{gate,up,down}_exps` with biases), their
blocks kept; for Q8_0 the oracle's weights are first rounded as the file holds them.

Checks: greedy continuations of three prompts over 16 tokens equal transformers'; the first
prompt's last logits within TOLERANCE x their std (test_moe_qwen3.py's); every token's routing
decisions in every layer equal transformers' (no two experts tie there); each of gpt-oss's
particular pieces, removed from the engine's own network run eagerly, moves the logits by far
more than the tolerance: the sinks, the SwiGLU clamp, the router's bias and its top-k-then-softmax
scoring, the expert biases; transformers without the sliding window is far from the engine. The
Q8_0 file's engines give a prompt's logits bitwise alone and batched (fp32 and int8 compute), and
int8 compute stays within TOLERANCE_INT8 of transformers, greedy equal up to a near-tie. A checkpoint
of MXFP4 experts as released (`*_blocks`/`*_scales`, their nibble order) and llama.cpp's
converter's file of it give the same ggml MXFP4 blocks, byte for byte; engines of both keep them
and match transformers on the same values dequantized.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from family_checks import last_logits
from greedy_loop import greedy_generate, hf_greedy
from moe_checks import (
    ROUTER_SHARPNESS,
    converted_sources,
    eager_moe_engine,
    engine_builder,
    hf_last_logits,
    logit_error,
    oracle,
    routing,
)
from sharp_models import VOCAB_SIZE, sharpen, write_spm_tokenizer
from step_cases import prompts
from tiny_models import TINY_LIMITS
from transformers import AutoConfig, AutoModelForCausalLM, GptOssConfig

from ifb.builder import build as builder_build
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.errors import UnsupportedModelError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.rope import rope_tables
from ifb.builder.sources import gguf_config
from ifb.plugins.grouped_experts import ExpertActivation, ExpertVariant
from ifb.plugins.quant_formats import WeightFormat
from ifb.runtime.engine_format import RouterScoring
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.moe_block import MoeBlock
from ifb.runtime.step.step_inputs import RequestSlice

NEW_TOKENS = 16
PROMPT_LENGTHS = (11, 20, 29)
WINDOW = 8  # the sliding layers' window: every prompt is longer
# test_moe_qwen3.py's. Measured on the three prompts: dense fp32 and the F32 file 3.1-5.5e-6 x std,
# the Q8_0 file 1.7-4.2e-6 against the rounded oracle (0.11-0.52 against the unrounded one)
TOLERANCE = 1e-4
# A removed piece must move the logits by >= this many tolerances. Measured over the three prompts
# (the first is the test's): no sinks 2.3, 0.36, 0.07 x std; no clamp 1.2-1.8; no router bias
# 1.9-3.3; softmax over every expert 0.50-1.3; no gate/up bias 0.61-1.4; no down bias 0.80-0.85;
# transformers without the window 0.04 (11 tokens), 2.4, 3.3 (29 tokens, the test's)
MARGIN = 300
# test_moe_qwen3.py's: int8 activations, a router input moved that far can flip an expert. Measured
# 0.07-0.19 x std on the three prompts; greedy equal for 10, 10 and 3 tokens, each divergence where
# transformers' top two logits are 0.07-0.18 x std apart
TOLERANCE_INT8 = 0.5
# gate/up weights on a unit-rms input: gate/up outputs of std ~5, so the clamp at 7 acts on some
GATE_UP_STD = 0.6
SINK_STD = 1.0  # each head's sink logit, beside scores of std ~4 (tests/sharp_models.py)


def gptoss_config(**overrides: Any) -> GptOssConfig:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=64,  # one expert's; a multiple of 32: the down projection's K takes Q8_0 blocks
        num_local_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        max_position_embeddings=131072,  # the releases' (YaRN 32 x 4096)
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return GptOssConfig(**{**base, **overrides})


def write_gptoss_folder(path: Path, config: GptOssConfig) -> Path:
    """transformers' model of `config`, seeded, sharpened, with gpt-oss's own tensors at scales
    where each matters (module docstring), saved with a SentencePiece tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    sharpen(model, config, generator)
    scales = {  # name suffix -> std of a fresh draw (sharpen does not know these names)
        "mlp.experts.gate_up_proj": GATE_UP_STD,
        "mlp.experts.down_proj": 0.02,
        "mlp.experts.gate_up_proj_bias": 1.0,
        "mlp.experts.down_proj_bias": 0.5,
        "mlp.router.bias": 1.0,
        "self_attn.sinks": SINK_STD,
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = next((std for suffix, std in scales.items() if name.endswith(suffix)), None)
            if std is not None:
                param.copy_(std * torch.randn(param.shape, generator=generator))
            if name.endswith("mlp.router.weight"):
                param.mul_(ROUTER_SHARPNESS)
    model.save_pretrained(path)
    write_spm_tokenizer(path)
    return path


def reference(name: str, folder: Path) -> torch.nn.Module:
    """transformers on the HF folder; for the Q8_0 file, every weight the file holds as Q8_0 rounded
    through Q8_0 along the file's rows as gguf-py rounds them: the attention's, head and embedding
    along their last dim, the experts along hidden (gate/up) and I (down), i.e. transposed; the
    router, sinks, norms and biases are F32 there."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    hf = oracle(folder)
    if name != "gguf-q8_0":
        return hf
    q8 = GGMLQuantizationType.Q8_0

    def rounded(rows: torch.Tensor) -> torch.Tensor:
        values = rows.contiguous().numpy().astype(np.float32)
        return torch.from_numpy(dequantize(quantize(values, q8), q8).reshape(values.shape))

    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if param_name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                param.copy_(rounded(param.transpose(-1, -2)).transpose(-1, -2))
            elif param.ndim == 2 and param_name.endswith(".weight") and not param_name.endswith("router.weight"):
                param.copy_(rounded(param))
    return hf


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = write_gptoss_folder(tmp_path_factory.mktemp("gptoss") / "hf", gptoss_config())
    return converted_sources(folder)


@pytest.fixture(scope="module")
def engines(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    get, built = engine_builder(sources, tmp_path_factory.mktemp("gptoss-engines"))
    yield get
    built.clear()


@pytest.fixture(scope="module")
def int8_engine(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The Q8_0 file's engine multiplying its blocks with int8 activations (`--compute int8`)."""
    folder = tmp_path_factory.mktemp("gptoss-int8") / "engine"
    options = BuildOptions(dtype="fp32", weights="auto", compute="int8", **TINY_LIMITS)
    with pytest.MonkeyPatch.context() as patch:  # the step cost calibration is not under test
        patch.setattr(builder_build, "calibrate_engine_folder", lambda folder, build_info, **_: None)
        build_engine(sources["q8_0"], folder, options)
    return Engine.load(folder, StepMode.COMPILED)


def test_the_spec_carries_every_piece_from_the_folder_and_the_files(sources: dict[str, Path]) -> None:
    """From the folder and from llama.cpp's files alike: the files hold no SwiGLU constants nor
    YaRN's truncate, and are read with the releases' values; the YaRN tables are transformers'."""
    config = AutoConfig.from_pretrained(sources["hf"])
    spec = model_spec_from_hf_config(config)
    assert (spec.architecture, spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (
        "gpt_oss", 8, 2, 64,
    )  # fmt: skip
    assert (spec.router_scoring, spec.router_bias, spec.expert_bias) == (RouterScoring.TOP_K_SOFTMAX, True, True)
    assert (spec.swiglu_alpha, spec.swiglu_limit, spec.attention_sinks) == (1.702, 7.0, True)
    assert (spec.attention_bias, spec.attention_out_bias) == (True, True)
    assert (spec.sliding_window, spec.full_attention_layers) == (WINDOW, (1,))
    inv_freq, scale = rope_tables(config, 256)
    for outtype in ("f32", "q8_0"):
        file_config = gguf_config(sources[outtype])
        from_file = model_spec_from_hf_config(file_config)
        assert from_file.rms_norm_eps == pytest.approx(spec.rms_norm_eps, rel=1e-6)  # stored as float32
        assert replace(from_file, rms_norm_eps=spec.rms_norm_eps) == spec
        file_inv_freq, file_scale = rope_tables(file_config, 256)
        assert torch.equal(file_inv_freq, inv_freq) and file_scale == scale
    truncated = AutoConfig.from_pretrained(sources["hf"])
    truncated.rope_parameters = {**truncated.rope_parameters, "truncate": True}
    assert not torch.equal(rope_tables(truncated, 256)[0], inv_freq)  # so the flag was read


def test_a_checkpoint_quantized_otherwise_than_mxfp4_is_refused_by_name() -> None:
    config = gptoss_config(quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(UnsupportedModelError, match=r"quant_method='bitsandbytes' is not supported; only .*'mxfp4'"):
        model_spec_from_hf_config(config)


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


def test_int8_compute_stays_close_to_transformers(sources: dict[str, Path], int8_engine: Engine) -> None:
    """Q8_0 weights with int8 activations (the grouped variant op's int8 path): logits within
    TOLERANCE_INT8 x std on every prompt, and greedy output transformers' until a token where
    transformers' top two logits are within that much of each other (a near-tie int8 may flip)."""
    assert int8_engine.config.weight_compute == "int8"
    hf = reference("gguf-q8_0", sources["hf"])
    texts = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)
    errors = [logit_error(int8_engine, hf, text) for text in texts]
    assert max(errors) <= TOLERANCE_INT8, errors
    for text in texts:
        ours, theirs = greedy_generate(int8_engine, text, NEW_TOKENS), hf_greedy(hf, text, NEW_TOKENS)
        agreed = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), NEW_TOKENS)
        assert agreed >= 1, (len(text), ours, theirs)
        if agreed < NEW_TOKENS:
            logits = hf_last_logits(hf, text + theirs[:agreed])
            top = logits.topk(2).values
            assert top[0] - top[1] <= TOLERANCE_INT8 * logits.std(), (len(text), agreed, top)


@pytest.mark.parametrize("compute", ["fp32", "int8"])
def test_a_prompts_logits_are_bitwise_the_same_alone_and_batched(
    compute: str, engines: Any, int8_engine: Engine
) -> None:
    """The Q8_0 file's engines (every linear and expert a block weight): three prompts whose tokens
    route to different experts, each one's last logits alone equal, bit for bit, its logits in one
    step beside the other two (in reverse order)."""
    engine = int8_engine if compute == "int8" else engines("gguf-q8_0")
    texts = prompts(VOCAB_SIZE, [23, 9, 31], seed=5)
    tables = [[3, 17], [9], [41, 1]]
    slices = [RequestSlice(text, 0, table, True) for text, table in zip(texts, tables, strict=True)]
    alone = [last_logits(engine, [[piece]])[0] for piece in slices]
    batched = last_logits(engine, [slices[::-1]])
    for row in range(3):
        assert torch.equal(batched[2 - row], alone[row]), (compute, row)


def test_routing_decisions_equal_transformers(sources: dict[str, Path], engines: Any) -> None:
    """Every prompt token's top-2 experts, in both layers, as transformers picks them (from the
    router's logits with its bias)."""
    eager, blocks = eager_moe_engine(engines("dense-fp32"))
    hf = oracle(sources["hf"])
    for text in prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11):
        for layer, (ours, theirs) in enumerate(routing(eager, blocks, hf, text)):
            assert ours == theirs, (len(text), layer)


def _no_sinks(eager: Engine, blocks: list[MoeBlock]) -> None:
    for layer in eager.backend.network.layers:  # type: ignore[attr-defined]
        layer.attn.sinks.data.fill_(-1e30)  # exp(-1e30 - max) = 0: the sink weighs nothing


def _no_clamp(eager: Engine, blocks: list[MoeBlock]) -> None:
    for block in blocks:
        block.variant = ExpertVariant(ExpertActivation.SWIGLU_CLAMPED, alpha=1.702, limit=1e30)


def _no_router_bias(eager: Engine, blocks: list[MoeBlock]) -> None:
    for block in blocks:
        assert block.router.bias is not None
        block.router.bias.data.zero_()


def _softmax_over_every_expert(eager: Engine, blocks: list[MoeBlock]) -> None:
    for block in blocks:
        block.scoring = RouterScoring.SOFTMAX_TOP_K  # the top k's probabilities, not renormalized


def _no_gate_up_bias(eager: Engine, blocks: list[MoeBlock]) -> None:
    for block in blocks:
        block.experts_gate_up_bias = None


def _no_down_bias(eager: Engine, blocks: list[MoeBlock]) -> None:
    for block in blocks:
        block.experts_down_bias = None


REMOVALS: dict[str, Callable[[Engine, list[MoeBlock]], None]] = {
    "sinks": _no_sinks,
    "swiglu clamp": _no_clamp,
    "router bias": _no_router_bias,
    "top-k then softmax": _softmax_over_every_expert,
    "gate/up bias": _no_gate_up_bias,
    "down bias": _no_down_bias,
}


@pytest.mark.parametrize("removed", list(REMOVALS))
def test_each_piece_of_gpt_oss_matters(removed: str, sources: dict[str, Path], engines: Any) -> None:
    """The dense engine's own network, run eagerly with one piece removed, is far from transformers:
    the tolerance above would catch an engine that lacked it."""
    eager, blocks = eager_moe_engine(engines("dense-fp32"))
    text = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)[0]
    hf = oracle(sources["hf"])
    assert logit_error(eager, hf, text) <= TOLERANCE
    REMOVALS[removed](eager, blocks)
    moved = logit_error(eager, hf, text)
    assert moved >= MARGIN * TOLERANCE, f"without the {removed}: logits move {moved:.2e} x std"


def test_the_sliding_window_matters(sources: dict[str, Path], engines: Any) -> None:
    """transformers with every layer full is far from the engine, which is within the tolerance of
    transformers with the window: the engine applies it (on the even layers; the prompt is longer)."""
    eager, _ = eager_moe_engine(engines("dense-fp32"))
    text = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)[-1]
    assert len(text) > WINDOW
    assert logit_error(eager, oracle(sources["hf"]), text) <= TOLERANCE
    every_layer_full = oracle(sources["hf"], layer_types=["full_attention"] * 2)
    moved = logit_error(eager, every_layer_full, text)
    assert moved >= MARGIN * TOLERANCE, f"without the window: logits move {moved:.2e} x std"


def write_mxfp4_folders(root: Path, dense: Path) -> tuple[Path, Path]:
    """The dense folder's model with random MXFP4 experts, twice: as the released checkpoints hold
    them (`*_blocks` [E, rows, K/32, 16] in their nibble order, `*_scales` [E, rows, K/32] e8m0,
    quantization_config mxfp4), and dense, dequantized by transformers' own
    `convert_moe_packed_tensors` (the oracle's weights: the MXFP4 values exactly)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(dense / "model.safetensors")
    config = json.loads((dense / "config.json").read_text())
    generator = torch.Generator().manual_seed(1)
    packed, dequantized = {}, {}
    # (rows, K, e8m0 exponent around which the scales sit): gate/up ~GATE_UP_STD, down ~0.02
    shapes = {"gate_up_proj": (2 * config["intermediate_size"], config["hidden_size"], 125),
              "down_proj": (config["hidden_size"], config["intermediate_size"], 120)}  # fmt: skip
    experts = config["num_local_experts"]
    for name in [n for n in tensors if n.endswith(tuple(f"mlp.experts.{proj}" for proj in shapes))]:
        rows, k, exponent = shapes[name.rpartition(".")[2]]
        blocks = torch.randint(0, 256, (experts, rows, k // 32, 16), dtype=torch.uint8, generator=generator)
        scales = torch.randint(exponent - 1, exponent + 2, (experts, rows, k // 32), generator=generator)
        scales = scales.to(torch.uint8)
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert dequantized[name].shape == tensors[name].shape
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    folders = (root / "mxfp4", root / "mxfp4-oracle")
    for folder, experts_as in zip(folders, (packed, dequantized), strict=True):
        folder.mkdir(parents=True)
        kept = {n: t for n, t in tensors.items() if n not in dequantized}
        save_file({**kept, **experts_as}, folder / "model.safetensors", metadata={"format": "pt"})
        for extra in ("tokenizer.model", "tokenizer_config.json"):
            shutil.copyfile(dense / extra, folder / extra)
        quantized = {"quantization_config": {"quant_method": "mxfp4"}} if experts_as is packed else {}
        (folder / "config.json").write_text(json.dumps({**config, **quantized}, indent=2))
    return folders


@pytest.fixture(scope="module")
def mxfp4_sources(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The MXFP4 checkpoint, llama.cpp's F32 file of it (experts MXFP4 there too), the dense oracle."""
    root = tmp_path_factory.mktemp("gptoss-mxfp4")
    packed, dense = write_mxfp4_folders(root / "checkpoints", sources["hf"])
    return {"hf": packed, "gguf": converted_sources(packed)["f32"], "oracle": dense}


@pytest.fixture(scope="module")
def mxfp4_engines(mxfp4_sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Engine]:
    """Engines of the checkpoint and of the converter's file, each keeping the MXFP4 experts."""
    root = tmp_path_factory.mktemp("gptoss-mxfp4-engines")
    options = BuildOptions(dtype="fp32", weights="auto", compute="fp32", **TINY_LIMITS)
    engines = {}
    for name in ("hf", "gguf"):
        with pytest.MonkeyPatch.context() as patch:  # the step cost calibration is not under test
            patch.setattr(builder_build, "calibrate_engine_folder", lambda folder, build_info, **_: None)
            build_engine(mxfp4_sources[name], root / name, options)
        engines[name] = Engine.load(root / name, StepMode.COMPILED)
    return engines


def test_the_checkpoints_mxfp4_experts_are_the_converters_blocks(mxfp4_sources: dict[str, Path]) -> None:
    """Each expert's blocks as read from the checkpoint (repacked here) are llama.cpp's converter's,
    byte for byte, and their values transformers' own dequantization of the checkpoint."""
    from ifb.builder.checkpoint_tensors import CheckpointTensors
    from ifb.builder.gguf_tensors import GgufTensors

    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(mxfp4_sources["hf"]))
    ours, converters = CheckpointTensors(mxfp4_sources["hf"], spec), GgufTensors(mxfp4_sources["gguf"], spec)
    dense = CheckpointTensors(mxfp4_sources["oracle"], spec)
    assert set(ours.experts) == set(converters.experts) and ours.experts
    for module in ours.experts:
        assert ours.info(ours.experts[module][0]).block_format is WeightFormat.MXFP4
        for expert in range(spec.num_experts):
            theirs = torch.cat(converters.expert_block_rows(module, expert))
            assert torch.equal(torch.cat(ours.expert_block_rows(module, expert)), theirs), (module, expert)
            assert torch.equal(ours.expert_fp32(module, expert), dense.expert_fp32(module, expert)), (module, expert)


@pytest.mark.parametrize("name", ["hf", "gguf"])
def test_mxfp4_experts_match_transformers(name: str, mxfp4_sources: dict[str, Path], mxfp4_engines: Any) -> None:
    """A checkpoint of MXFP4 experts as released, and llama.cpp's converter's file of it: the
    engine keeps them as MXFP4 blocks and matches transformers on the same values dequantized
    (greedy over 16 tokens, last logits within the tolerance). Measured, both engines: 2.0-4.2e-6 x
    std on the three prompts; against transformers on the blocks read with each byte's nibbles
    swapped, 4.1-4.3 x std."""
    engine = mxfp4_engines[name]
    experts = {module: fmt for module, fmt in engine.config.weight_formats.items() if ".mlp.experts_" in module}
    assert experts and set(experts.values()) == {"mxfp4"}, engine.config.weight_formats
    hf = oracle(mxfp4_sources["oracle"])
    texts = prompts(VOCAB_SIZE, list(PROMPT_LENGTHS), seed=11)
    error = logit_error(engine, hf, texts[0])
    assert error <= TOLERANCE, f"mxfp4 {name}: max logit error {error:.2e} x std"
    for text in texts:
        assert greedy_generate(engine, text, NEW_TOKENS) == hf_greedy(hf, text, NEW_TOKENS), len(text)
