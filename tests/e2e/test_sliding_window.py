"""Sliding-window attention (Mistral, Phi-3) through the real builder, HF folder and GGUF.

Pins: `ModelSpec.sliding_window` is read from an HF config and from a GGUF's
`{arch}.attention.sliding_window`, engines build with max_seq_len far past the window, and every
query attends to the keys p with position - p < window, exactly as transformers' sliding-window
mask: greedy output and last logits equal transformers fp32 for prompts shorter and longer than
the window, prefilled whole or in chunks that cut it; on a block-quantized engine (the decode
kernel's windowed path) a request's logits are bitwise the same alone or batched, whole or
chunked, and after a reused prefix; the compiled, eager and reference attention paths agree.

The window is 8 positions, half a block of 16, so it cuts inside blocks and a 40-token prompt
spans five windows; the scheduler runs it in flight with prefix reuse and chunking, and the ONNX
graph the TensorRT backend builds from applies it too. Each test was checked to fail with the
network's window disabled or one key wider (the GGUF key's test: with the key left unread).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checks import (
    assert_bitwise_invariant,
    assert_greedy_equals,
    assert_last_logits_close,
    assert_step_modes_agree,
    build_fp32,
    gguf_oracle,
)
from greedy_loop import greedy_generate, hf_greedy
from step_cases import prompts
from tiny_models import write_gguf, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.sources import gguf_config
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine

WINDOW = 8
PROMPT_LENGTHS = [5, 23, 40]  # shorter than the window, and longer


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-mistral"), "mistral", seed=8, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def mistral_gguf(tmp_path_factory: pytest.TempPathFactory, mistral_dir: Path) -> Path:
    """As llama.cpp writes Mistral (arch llama, q/k rows permuted), Q8_0 blocks, and the window."""
    path = tmp_path_factory.mktemp("tiny-mistral-gguf") / "tiny-mistral-q8_0.gguf"
    return write_gguf(path, mistral_dir, linear_type="Q8_0", embed_type="Q8_0")


@pytest.fixture(scope="module")
def folder_engine(tmp_path_factory: pytest.TempPathFactory, mistral_dir: Path) -> Path:
    return build_fp32(mistral_dir, tmp_path_factory.mktemp("engines") / "mistral-fp32")


@pytest.fixture(scope="module")
def gguf_engine(tmp_path_factory: pytest.TempPathFactory, mistral_gguf: Path) -> Path:
    return build_fp32(mistral_gguf, tmp_path_factory.mktemp("engines") / "mistral-q8_0")


def _gguf_oracle(path: Path) -> torch.nn.Module:
    """transformers' MistralForCausalLM on the GGUF's weights (the builder's load_model: its GGUF
    loader maps no mistral tensors, so it reads the file as Llama), read as the windowed Mistral."""
    model = gguf_oracle(path)
    assert (model.config.model_type, model.config.sliding_window) == ("mistral", WINDOW)
    return model


def _assert_greedy_equals(engine: Engine, hf: torch.nn.Module) -> None:
    # chunks that start inside, at and past a window
    assert_greedy_equals(engine, hf.eval(), PROMPT_LENGTHS, 24, chunks=(3, WINDOW + 1, 16))


def test_folder_engine_records_the_window_and_equals_transformers(mistral_dir: Path, folder_engine: Path) -> None:
    """Dense fp32 engine (SDPA context path, masked decode path), max_seq_len 256 = 32 windows."""
    engine = Engine.load(folder_engine, StepMode.COMPILED)
    assert (engine.config.spec.architecture, engine.config.spec.sliding_window) == ("mistral", WINDOW)
    assert engine.config.limits.max_seq_len == 256
    _assert_greedy_equals(engine, AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32))


def test_gguf_engine_keeps_blocks_and_equals_transformers_gguf_loader(mistral_gguf: Path, gguf_engine: Path) -> None:
    """Block-quantized engine: both attention paths in the decode kernel's windowed op."""
    config = EngineConfig.load(gguf_engine)
    assert (config.spec.architecture, config.spec.sliding_window) == ("mistral", WINDOW)
    assert config.kernels is not None and set(config.weight_formats.values()) == {"q8_0"}
    _assert_greedy_equals(Engine.load(gguf_engine, StepMode.COMPILED), _gguf_oracle(mistral_gguf))


def test_the_gguf_key_decides_the_window(mistral_gguf: Path, tmp_path: Path) -> None:
    """A Llama-arch GGUF declaring `llama.attention.sliding_window` reads as Mistral with it;
    without the key (how llama.cpp writes every Mistral) it reads as the Llama it then is, with
    no window (as llama.cpp runs it), not MistralConfig's default 4096. A Phi-3 file's window is
    read too (transformers' GGUF reader drops it; the checkpoint's own applies in transformers)."""
    from ifb.builder.hf_config import model_spec_from_hf_config

    windowed = gguf_config(mistral_gguf)
    assert (windowed.model_type, model_spec_from_hf_config(windowed).sliding_window) == ("mistral", WINDOW)
    plain = write_hf_checkpoint(tmp_path / "plain", "mistral", seed=8)
    config = gguf_config(write_gguf(tmp_path / "plain.gguf", plain))
    assert config.model_type == "llama" and model_spec_from_hf_config(config).sliding_window is None
    phi3 = write_hf_checkpoint(tmp_path / "phi3", "phi3", seed=6, sliding_window=16)  # `phi3.attention.sliding_window`
    config = gguf_config(write_gguf(tmp_path / "phi3.gguf", phi3))
    assert (config.model_type, model_spec_from_hf_config(config).sliding_window) == ("phi3", 16)


def test_windowed_logits_are_bitwise_batch_chunk_and_prefix_invariant(mistral_gguf: Path, gguf_engine: Path) -> None:
    """A prompt's last logits, bit for bit: alone; beside other prompts and a decode deep past
    its window; prefilled in two chunks split around window edges; and after a reused prefix
    (its first two blocks written by another request, whose table it shares). Alone, they are
    transformers' (so a window ignored everywhere alike fails here too)."""
    assert_bitwise_invariant(Engine.load(gguf_engine, StepMode.COMPILED), _gguf_oracle(mistral_gguf), WINDOW)


def test_compiled_eager_and_reference_paths_agree_past_the_window(
    mistral_dir: Path, mistral_gguf: Path, folder_engine: Path, gguf_engine: Path
) -> None:
    """One mixed step (a chunk past the window over cached context, a whole prompt, a deep
    decode) in all three step modes of both engines: the reference loops, the torch masks and
    the kernel apply the same window, transformers' (the reference's logits are its)."""
    assert_step_modes_agree(
        folder_engine, AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    )
    assert_step_modes_agree(gguf_engine, _gguf_oracle(mistral_gguf))


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


@pytest.mark.parametrize("settings", [{}, {"max_num_tokens": 16}], ids=["whole_prompts", "chunked_16"])
def test_in_flight_batching_with_prefix_reuse_equals_alone(
    mistral_gguf: Path, gguf_engine: Path, settings: dict[str, int]
) -> None:
    """32 requests arriving over time (prompts to 72 tokens, many sharing a 16- or 32-token
    prefix, so reused blocks and chunk edges fall mid-window) through the scheduler and the
    prefix cache: every output equals its request run alone, and the four longest alone equal
    transformers (so a window ignored everywhere alike fails here too)."""
    from test_runtime import run_arriving_over_time, workload

    from ifb import LLM

    items = workload(5)
    engine = Engine.load(gguf_engine, StepMode.COMPILED)
    alone = {i: greedy_generate(engine, prompt, n) for i, (prompt, n) in enumerate(items)}
    hf = _gguf_oracle(mistral_gguf)
    longest = sorted(range(len(items)), key=lambda i: len(items[i][0]) + items[i][1])[-4:]
    assert all(alone[i] == hf_greedy(hf, items[i][0], items[i][1]) for i in longest)
    with LLM(gguf_engine, **settings) as llm:
        results = run_arriving_over_time(llm, items, seed=9)
        stats = llm.stats()
        llm.executor.scheduler.check_integrity()
    assert results == alone
    assert stats.kv.prefix_cache_hit_tokens > 0


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
