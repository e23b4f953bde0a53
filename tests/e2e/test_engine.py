"""The engine compiler end to end on tiny models: reference vs HF, compiled vs reference, greedy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_loop import greedy_generate, scattered_blocks
from step_cases import FP32_TOLERANCE, mixed_step_slices, prompts, run_mixed_step
from transformers import AutoModelForCausalLM

from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs


def hf_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "engine_fixture,hf_fixture", [("tiny_llama_engine", "tiny_llama_dir"), ("tiny_qwen2_engine", "tiny_qwen2_dir")]
)
def test_reference_network_matches_transformers(
    engine_fixture: str, hf_fixture: str, request: pytest.FixtureRequest
) -> None:
    """Prefill logits and several decode steps of the reference path equal HF on scattered blocks."""
    engine = Engine.load(request.getfixturevalue(engine_fixture), StepMode.REFERENCE)
    hf = hf_model(request.getfixturevalue(hf_fixture))
    (prompt,) = prompts(engine.config.spec.vocab_size, [37])
    block_size = engine.config.limits.block_size
    table = scattered_blocks(engine, 64)
    assert table != sorted(table)
    logits = engine.step(build_step_inputs([RequestSlice(prompt, 0, table, True)], block_size))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - expected).abs().max().item() < FP32_TOLERANCE
    tokens = list(prompt)
    for step in range(5):
        tokens.append(int(logits[0].argmax()))
        inputs = build_step_inputs([RequestSlice(tokens[-1:], len(tokens) - 1, table, True)], block_size)
        logits = engine.step(inputs)
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0, -1]
        assert (logits[0] - expected).abs().max().item() < FP32_TOLERANCE, f"decode step {step}"


@pytest.mark.parametrize("engine_fixture", ["tiny_llama_engine", "tiny_qwen2_engine"])
def test_compiled_matches_reference_on_mixed_step(engine_fixture: str, request: pytest.FixtureRequest) -> None:
    """Two prefill chunks of different lengths plus two decodes of different context in one call."""
    folder = request.getfixturevalue(engine_fixture)
    results = {}
    for mode in (StepMode.REFERENCE, StepMode.EAGER, StepMode.COMPILED):
        engine = Engine.load(folder, mode)
        results[mode] = (run_mixed_step(engine), engine.kv_cache.clone())
    ref_logits, ref_kv = results[StepMode.REFERENCE]
    assert ref_logits.shape == (4, engine.config.spec.vocab_size)
    for mode in (StepMode.EAGER, StepMode.COMPILED):
        logits, kv = results[mode]
        assert (logits - ref_logits).abs().max().item() < FP32_TOLERANCE, mode
        assert (kv - ref_kv).abs().max().item() < 1e-5, mode


def test_mixed_step_logits_equal_each_request_alone(tiny_llama_engine: Path) -> None:
    """Packing is invisible: each row of a mixed step equals the same request stepped alone."""
    engine = Engine.load(tiny_llama_engine, StepMode.COMPILED)
    warmup, mixed = mixed_step_slices(engine)
    block_size = engine.config.limits.block_size
    engine.step(build_step_inputs(warmup, block_size))
    snapshot = engine.kv_cache.clone()
    together = engine.step(build_step_inputs(mixed, block_size))
    for row, piece in enumerate(mixed):
        engine.kv_cache.copy_(snapshot)
        alone = engine.step(build_step_inputs([piece], block_size))
        assert (alone[0] - together[row]).abs().max().item() < FP32_TOLERANCE


@pytest.mark.parametrize(
    "engine_fixture,hf_fixture",
    [
        ("tiny_llama_engine", "tiny_llama_dir"),
        ("tiny_qwen2_engine", "tiny_qwen2_dir"),
        ("tiny_gguf_engine", "tiny_llama_dir"),
    ],
)
def test_compiled_greedy_equals_transformers_generate(
    engine_fixture: str, hf_fixture: str, request: pytest.FixtureRequest
) -> None:
    """Token-for-token equality with HF greedy generate, prefill whole and in chunks."""
    engine = Engine.load(request.getfixturevalue(engine_fixture), StepMode.COMPILED)
    hf = hf_model(request.getfixturevalue(hf_fixture))
    for prompt in prompts(engine.config.spec.vocab_size, [5, 23, 40], seed=7):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert greedy_generate(engine, prompt, 24) == expected
        assert greedy_generate(engine, prompt, 24, chunk=16) == expected
