"""Engines with block-quantized weights (GGUF Q4_1/Q8_0 kept, or HF quantized at build time).

Pins: the GGUF's blocks reach the engine (dequantizing to exactly what transformers' GGUF loader
loads), greedy output equals transformers fp32 on the same dequantized weights, a request's
logits and K/V are bitwise the same alone or inside any batch, and the refusals: a CPU lacking a
kernel feature, block formats with bf16 or with the tensorrt backend.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from greedy_loop import greedy_generate, hf_greedy
from step_cases import prompts, run_mixed_step
from tiny_models import TINY_LIMITS
from transformers import AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.errors import BuildError
from ifb.builder.families.llama import Llama
from ifb.plugins.quant_formats import WeightFormat, dequantize, quantize
from ifb.runtime.engine_format import RECORD_SHA256, BackendKind, EngineConfig, record_sha256
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.health_report import engine_block
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

LINEARS = ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down")
QUANT_ENGINES = ["tiny_q4_gguf_engine", "tiny_qwen2_q8_engine", "tiny_q4_gguf_int8_engine"]
# fp16 KV keeps the invariance: the write rounds each element alone and both attention paths
# upcast each gathered element alone, so nothing depends on what else is in the step.
BATCH_INVARIANT_ENGINES = [*QUANT_ENGINES, "tiny_q4_gguf_kv16_engine"]


def _all_linears(num_layers: int) -> set[str]:
    return {f"layers.{i}.{name}" for i in range(num_layers) for name in LINEARS} | {"lm_head"}


def _dequantized_hf(folder: Path, fmt: WeightFormat) -> torch.nn.Module:
    """HF transformers fp32 on the weights a `--weights fmt` engine stores (tied head included)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) or name == "model.embed_tokens":
                module.weight.copy_(dequantize(quantize(module.weight, fmt), fmt))
    return model


def test_gguf_blocks_are_kept_and_recorded(tiny_q4_gguf_engine: Path) -> None:
    """`--weights auto` on a Q4_1 GGUF: every linear and the head packed, fp32 activations, kernels shipped."""
    config = EngineConfig.load(tiny_q4_gguf_engine)
    # the untied Q8_0 embedding is read as blocks too, never an fp32 table
    assert config.weight_formats == {**dict.fromkeys(_all_linears(config.spec.num_layers), "q4_1"), "embed": "q8_0"}
    assert config.dtype == "float32"
    assert config.kernels is not None and config.kernels.path in config.artifacts
    assert config.kernels_path is not None and config.kernels_path.is_file()
    assert not list(tiny_q4_gguf_engine.glob("kernels/*.o")) and not list(tiny_q4_gguf_engine.glob("kernels/obj-*"))


def test_gguf_engine_greedy_equals_transformers_gguf_loader(tiny_q4_gguf: Path, tiny_q4_gguf_engine: Path) -> None:
    """Token-for-token equality with transformers' own (dequantizing) GGUF load, whole and chunked prefill."""
    engine = Engine.load(tiny_q4_gguf_engine, StepMode.COMPILED)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_q4_gguf.parent, gguf_file=tiny_q4_gguf.name, dtype=torch.float32
    ).eval()
    for prompt in prompts(engine.config.spec.vocab_size, [5, 23, 40], seed=7):
        expected = hf_greedy(hf, prompt, 24)
        assert greedy_generate(engine, prompt, 24) == expected
        assert greedy_generate(engine, prompt, 24, chunk=16) == expected


def test_q8_0_engine_greedy_equals_transformers_on_dequantized_weights(
    tiny_qwen2_dir: Path, tiny_qwen2_q8_engine: Path
) -> None:
    """HF Qwen2 + `--weights q8_0` (tied head, qkv bias) == HF fp32 on the round-tripped weights."""
    engine = Engine.load(tiny_qwen2_q8_engine, StepMode.COMPILED)
    expected = {**dict.fromkeys(_all_linears(engine.config.spec.num_layers), "q8_0"), "embed": "q8_0"}
    assert engine.config.weight_formats == expected  # the tied embedding reads the head's tiles
    hf = _dequantized_hf(tiny_qwen2_dir, WeightFormat.Q8_0)
    for prompt in prompts(engine.config.spec.vocab_size, [5, 23, 40], seed=7):
        assert greedy_generate(engine, prompt, 24) == hf_greedy(hf, prompt, 24)


@pytest.mark.parametrize("engine_fixture", QUANT_ENGINES)
def test_compiled_matches_eager_and_reference_on_mixed_step(
    engine_fixture: str, request: pytest.FixtureRequest
) -> None:
    """Same quant kernel in all three modes; only Inductor's RMSNorm and decode-softmax reductions
    differ from ATen's summation order (measured max 3e-8), so logits agree to 1e-6, K/V to 1e-6."""
    folder = request.getfixturevalue(engine_fixture)
    results = {}
    for mode in (StepMode.REFERENCE, StepMode.EAGER, StepMode.COMPILED):
        engine = Engine.load(folder, mode)
        results[mode] = (run_mixed_step(engine), engine.kv_cache.clone())
    compiled_logits, compiled_kv = results[StepMode.COMPILED]
    for mode in (StepMode.REFERENCE, StepMode.EAGER):
        logits, kv = results[mode]
        assert (logits - compiled_logits).abs().max().item() < 1e-6, mode
        assert (kv - compiled_kv).abs().max().item() < 1e-6, mode


def _invariance_slices(vocab: int) -> tuple[list[RequestSlice], list[RequestSlice]]:
    """Warm-up prefills, then a step of two chunks (short/long context) and three decodes of
    very different context lengths (1 block vs 10 blocks), so padding differs alone vs together."""
    a, b, c, d, e = prompts(vocab, [40, 12, 150, 7, 30], seed=5)
    tables = [[3, 17, 9], [40, 2], list(range(20, 30)), [46], [11, 12]]
    warmup = [
        RequestSlice(a[:24], 0, tables[0], False),
        RequestSlice(c[:60], 0, tables[2], False),
        RequestSlice(d, 0, tables[3], True),
        RequestSlice(e, 0, tables[4], True),
    ]
    more = [RequestSlice(c[60:120], 60, tables[2], False)]
    last = [RequestSlice(c[120:], 120, tables[2], True)]
    mixed = [
        RequestSlice([5], 150, tables[2], True),  # decode over 10 blocks
        RequestSlice(a[24:], 24, tables[0], True),  # chunk over cached context
        RequestSlice([9], 7, tables[3], True),  # decode over 1 block
        RequestSlice(b, 0, tables[1], True),  # whole prompt
        RequestSlice([3], 30, tables[4], True),  # decode over 2 blocks
    ]
    return warmup + more + last, mixed


@pytest.mark.parametrize("engine_fixture", BATCH_INVARIANT_ENGINES)
def test_logits_and_kv_are_bitwise_batch_invariant(engine_fixture: str, request: pytest.FixtureRequest) -> None:
    """Each request's logits and written K/V are bit for bit the same alone, in the batch, and
    in the batch with the order reversed (other rows, padding and positions around it)."""
    engine = Engine.load(request.getfixturevalue(engine_fixture), StepMode.COMPILED)
    block_size = engine.config.limits.block_size
    warmup, mixed = _invariance_slices(engine.config.spec.vocab_size)
    for piece in warmup:
        engine.step(build_step_inputs([piece], block_size))
    snapshot = engine.kv_cache.clone()
    together = engine.step(build_step_inputs(mixed, block_size))
    together_kv = engine.kv_cache.clone()
    engine.kv_cache.copy_(snapshot)
    reversed_logits = engine.step(build_step_inputs(mixed[::-1], block_size)).flip(0)
    assert torch.equal(reversed_logits, together)
    assert torch.equal(engine.kv_cache, together_kv)
    for row, piece in enumerate(mixed):
        engine.kv_cache.copy_(snapshot)
        alone = engine.step(build_step_inputs([piece], block_size))
        assert torch.equal(alone[0], together[row]), f"row {row}"
        slots = build_step_inputs([piece], block_size).slot_mapping
        assert torch.equal(engine.kv_cache[:, :, slots], together_kv[:, :, slots]), f"K/V of row {row}"


def _last_logits(engine: Engine, pieces: list[list[RequestSlice]]) -> torch.Tensor:
    """Run `pieces` as consecutive steps from an empty cache; the last step's logits."""
    engine.kv_cache.zero_()
    for piece in pieces:
        logits = engine.step(build_step_inputs(piece, engine.config.limits.block_size))
    return logits


@pytest.mark.parametrize("engine_fixture", BATCH_INVARIANT_ENGINES)
def test_prefill_logits_do_not_depend_on_chunking_reuse_or_neighbours(
    engine_fixture: str, request: pytest.FixtureRequest
) -> None:
    """A prompt's last-token logits are bit for bit the same prefilled whole, in two chunks (as
    after a reused prefix, the last chunk one token = a decode row), beside other prompts of
    other lengths, and beside a chunked long prompt. Before the context path went row by row
    through the decode kernel, SDPA's blocking made every split here differ in the last bits."""
    engine = Engine.load(request.getfixturevalue(engine_fixture), StepMode.COMPILED)
    lengths = [23, 41, 9, 57]
    texts = prompts(engine.config.spec.vocab_size, [*lengths, 150], seed=9)
    tables = [list(range(5 * i + 1, 5 * i + 5)) for i in range(len(lengths))]
    long_text, long_table = texts[-1], list(range(25, 35))
    whole = [RequestSlice(text, 0, table, True) for text, table in zip(texts, tables, strict=False)]
    alone = [_last_logits(engine, [[piece]])[0] for piece in whole]
    together = _last_logits(engine, [whole])
    long_head = RequestSlice(long_text[:100], 0, long_table, False)
    long_tail = RequestSlice(long_text[100:], 100, long_table, True)
    beside_long = _last_logits(engine, [[long_head], [long_tail, *whole]])[1:]
    for row, (text, table) in enumerate(zip(texts, tables, strict=False)):
        assert torch.equal(together[row], alone[row]), f"prompt {row} together"
        assert torch.equal(beside_long[row], alone[row]), f"prompt {row} beside a chunked long prompt"
        for split in sorted({1, 5, 16, len(text) - 1} & set(range(1, len(text)))):
            head, tail = RequestSlice(text[:split], 0, table, False), RequestSlice(text[split:], split, table, True)
            assert torch.equal(_last_logits(engine, [[head], [tail]])[0], alone[row]), f"prompt {row} split at {split}"


def test_int8_compute_is_recorded_and_close_to_the_exact_engine(
    tiny_q4_gguf_engine: Path, tiny_q4_gguf_int8_engine: Path
) -> None:
    """`--compute int8` is in engine.json and the rebuild command; on the same blocks its logits
    stay close to the exact engine's (int8 activations per 32-block: ~0.4% relative error per
    layer) and the greedy continuations mostly agree."""
    config = EngineConfig.load(tiny_q4_gguf_int8_engine)
    assert config.weight_compute == "int8" and config.weight_formats
    assert "--compute int8" in config.rebuild_command()
    assert EngineConfig.load(tiny_q4_gguf_engine).weight_compute == "fp32"
    shown = engine_block(config)  # what /health shows
    assert shown["weight_compute"] == "int8" and shown["kernels_isa"] == config.kernels.isa
    assert shown["weight_formats"] == sorted(set(config.weight_formats.values()))
    exact = Engine.load(tiny_q4_gguf_engine, StepMode.COMPILED)
    int8 = Engine.load(tiny_q4_gguf_int8_engine, StepMode.COMPILED)
    exact_logits, int8_logits = run_mixed_step(exact), run_mixed_step(int8)
    assert not torch.equal(exact_logits, int8_logits)  # really a different kernel
    relative = (int8_logits - exact_logits).norm() / exact_logits.norm()
    assert relative < 0.05, relative.item()
    exact_probs = exact_logits.log_softmax(-1)
    kl = (exact_probs.exp() * (exact_probs - int8_logits.log_softmax(-1))).sum(-1)
    assert kl.max().item() < 0.05, kl.tolist()
    vocab = config.spec.vocab_size
    agree = [
        greedy_generate(exact, prompt, 12) == greedy_generate(int8, prompt, 12)
        for prompt in prompts(vocab, [9, 23, 40])
    ]
    assert sum(agree) >= 2, agree


def test_int8_compute_needs_block_weights(tiny_q4_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="--compute int8 needs block-quantized weights"):
        build_engine(tiny_q4_gguf, tmp_path / "e", BuildOptions(weights="fp32", compute="int8", **TINY_LIMITS))


def test_engine_needing_a_missing_cpu_feature_is_refused(tiny_q4_gguf_engine: Path, tmp_path: Path) -> None:
    """One line naming the feature and the rebuild command; nothing is loaded."""
    folder = tmp_path / "engine"
    shutil.copytree(tiny_q4_gguf_engine, folder)
    record = json.loads((folder / "engine.json").read_text())
    record["kernels"]["cpu_features"].append("avx10_9000")
    record[RECORD_SHA256] = record_sha256(record)  # sealed, as a build on that CPU would have
    (folder / "engine.json").write_text(json.dumps(record))
    with pytest.raises(EngineFormatError) as caught:
        Engine.load(folder, StepMode.COMPILED)
    message = str(caught.value)
    assert "avx10_9000" in message and "ifb build" in message and "--weights auto" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "options,names",
    [
        (BuildOptions(weights="q4_1", backend=BackendKind.TENSORRT), ("--weights q4_1", "tensorrt")),
        (BuildOptions(weights="q4_1", dtype="bf16"), ("--weights q4_1", "--dtype bf16")),
    ],
)
def test_block_weights_refuse_tensorrt_and_bf16(
    options: BuildOptions, names: tuple[str, ...], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Refused in one line naming both options, before anything is written."""
    with pytest.raises(BuildError) as caught:
        build_engine(tiny_llama_dir, tmp_path / "engine", options)
    message = str(caught.value)
    assert all(name in message for name in names) and "\n" not in message
    assert not (tmp_path / "engine").exists()


def test_qk_unpermutation_is_what_makes_blocks_match_transformers(
    tiny_q4_gguf: Path, tiny_q4_gguf_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's own Q/K row un-permutation is load-bearing: Q/K blocks left in llama.cpp's row
    order give other logits than transformers' load of the same file."""
    monkeypatch.setattr(Llama, "gguf_permuted_qk", False)  # the family's fact the reader acts on
    folder = tmp_path / "engine"
    build_engine(tiny_q4_gguf, folder, BuildOptions(compute="fp32", **TINY_LIMITS))
    engine = Engine.load(folder, StepMode.COMPILED)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_q4_gguf.parent, gguf_file=tiny_q4_gguf.name, dtype=torch.float32
    ).eval()
    prompt = prompts(engine.config.spec.vocab_size, [23], seed=7)[0]
    block_size = engine.config.limits.block_size
    inputs = build_step_inputs([RequestSlice(prompt, 0, list(range(2)), sample=True)], block_size)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    kept = Engine.load(tiny_q4_gguf_engine, StepMode.COMPILED)
    right = (kept.step(inputs)[0] - expected).abs().max().item()
    wrong = (engine.step(inputs)[0] - expected).abs().max().item()
    # Permuted rows pair other dimensions under RoPE: the logits move far past the kernels' rounding.
    assert wrong > 20 * right, (right, wrong)
