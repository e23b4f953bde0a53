"""Sliding-window attention (Mistral, Phi-3) through the real builder, from HF folders.

Pins: `ModelSpec.sliding_window` is read from an HF config, engines build with max_seq_len far
past the window, and every query attends to the keys p with position - p < window, exactly as
transformers' sliding-window mask: greedy output and last logits equal transformers fp32 for
prompts shorter and longer than the window, prefilled whole or in chunks that cut it; the
compiled, eager and reference attention paths agree; the ONNX graph the TensorRT backend builds
from applies it too.

The window on a block-quantized engine (the decode kernel's windowed path: bitwise batch, chunk
and prefix invariance, the step modes, in-flight batching with prefix reuse) is pinned on files
llama.cpp's converter wrote (Phi-3 with a window on every layer, Gemma 2 and 3 on some):
test_converter_conformance.py, against transformers on the HF folder. llama.cpp writes no window
for a Mistral; `{arch}.attention.sliding_window` is read where the file has it.

The window is 8 positions, half a block of 16, so it cuts inside blocks and a 40-token prompt
spans five windows. Each test was checked to fail with the network's window disabled or one key
wider.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checks import (
    assert_greedy_equals,
    assert_last_logits_close,
    assert_step_modes_agree,
    build_fp32,
)
from greedy_loop import greedy_generate, hf_greedy
from step_cases import prompts
from tiny_models import write_gguf, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.sources import gguf_config
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine

WINDOW = 8
PROMPT_LENGTHS = [5, 23, 40]  # shorter than the window, and longer


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=8, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def folder_engine(tmp_path_factory: pytest.TempPathFactory, mistral_dir: Path) -> Path:
    return build_fp32(mistral_dir, tmp_path_factory.mktemp("engines") / "mistral-fp32")


def _assert_greedy_equals(engine: Engine, hf: torch.nn.Module) -> None:
    # chunks that start inside, at and past a window
    assert_greedy_equals(engine, hf.eval(), PROMPT_LENGTHS, 24, chunks=(3, WINDOW + 1, 16))


def test_folder_engine_records_the_window_and_equals_transformers(mistral_dir: Path, folder_engine: Path) -> None:
    """Dense fp32 engine (SDPA context path, masked decode path), max_seq_len 256 = 32 windows."""
    engine = Engine.load(folder_engine, StepMode.COMPILED)
    assert (engine.config.spec.architecture, engine.config.spec.sliding_window) == ("mistral", WINDOW)
    assert engine.config.limits.max_seq_len == 256
    _assert_greedy_equals(engine, AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32))


def test_a_llama_gguf_declaring_a_window_reads_as_mistral(mistral_dir: Path, tmp_path: Path) -> None:
    """A Llama-arch GGUF declaring `llama.attention.sliding_window` reads as Mistral with it.
    The file is our converter double's (tests/tiny_models.write_gguf): llama.cpp's converter
    never writes that key for a Mistral (test_converter_conformance.py: its file reads as the
    Llama it then is, with no window, as llama.cpp runs it; a Phi-3 file's window is read there
    too), so only a file made some other way carries it."""
    from ifb.builder.hf_config import model_spec_from_hf_config

    windowed = gguf_config(write_gguf(tmp_path / "windowed.gguf", mistral_dir))
    assert (windowed.model_type, model_spec_from_hf_config(windowed).sliding_window) == ("mistral", WINDOW)


def test_compiled_eager_and_reference_paths_agree_past_the_window(mistral_dir: Path, folder_engine: Path) -> None:
    """One mixed step (a chunk past the window over cached context, a whole prompt, a deep
    decode) in all three step modes of the folder's engine: the reference loops and the torch
    masks apply the same window, transformers' (the reference's logits are its). (The decode
    kernel's windowed path, on block-quantized files llama.cpp wrote: test_converter_conformance.py.)"""
    assert_step_modes_agree(
        folder_engine, AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    )


def test_phi3_window_applies_past_it_as_transformers(tmp_path: Path) -> None:
    """Phi-3's window used to bound max_seq_len; now an engine 16x longer than it applies it."""
    folder = write_hf_checkpoint(tmp_path / "phi3", "phi3", seed=6, sliding_window=16)
    engine = Engine.load(build_fp32(folder, tmp_path / "phi3-engine"), StepMode.COMPILED)
    assert (engine.config.spec.sliding_window, engine.config.limits.max_seq_len) == (16, 256)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for prompt in prompts(engine.config.spec.vocab_size, [9, 40], seed=7):
        expected = hf_greedy(hf, prompt, 20)
        assert greedy_generate(engine, prompt, 20) == expected
        assert greedy_generate(engine, prompt, 20, chunk=16) == expected
        assert_last_logits_close(engine, hf, prompt)


def test_the_onnx_graph_for_tensorrt_applies_the_window(mistral_dir: Path, folder_engine: Path, tmp_path: Path) -> None:
    """The step graph the TensorRT backend builds from, run by onnxruntime: greedy past the
    window, chunked, equals transformers."""
    from ifb.builder.export_onnx import export_onnx
    from ifb.runtime.step.backend import load_network
    from ifb.runtime.step.onnx_step import OnnxStep

    engine = Engine.load(folder_engine, StepMode.REFERENCE)
    network = load_network(engine.config, reference_ops=False)
    engine.backend = OnnxStep(export_onnx(network, engine.config.limits, engine.kv_cache, tmp_path / "step.onnx"))
    hf = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    for prompt in prompts(engine.config.spec.vocab_size, [23, 40], seed=7):
        assert greedy_generate(engine, prompt, 16, chunk=16) == hf_greedy(hf, prompt, 16)
