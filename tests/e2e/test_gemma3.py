"""Gemma 3 text (Gemma3ForCausalLM) through the real builder, from an HF folder and from a GGUF.

Pins: the spec read from transformers' Gemma3TextConfig and from llama.cpp's `gemma3` GGUF, and
the network's Gemma path: RMSNorm scaling by (1 + w) in fp32 (llama.cpp's file stores 1 + w,
taken off once), embeddings times sqrt(hidden), GeGLU with gelu's tanh approximation, four norms
a layer, q/k norms, the query_pre_attn_scalar attention scale, and interleaved local layers
(window 8, RoPE base rope_local_base_freq) and global ones (no window, rope_theta with linear
scaling). Greedy output and last logits equal transformers fp32 for prompts shorter and longer
than the window, prefilled whole or in chunks across its edges; on the block-quantized GGUF
engine (the decode kernel, windowed on local layers only) a prompt's logits are bitwise the
same alone, batched and chunked.

The tiny model's random weights make each of these matter: with the network's (1 + w), embed
scale, local RoPE table, per-layer window (none, or on every layer), attention scale, GeGLU or
sandwich norms disabled, its last logits move by 0.5-3 (exact gelu instead of tanh's: 8e-4),
against the 2e-5 these tests allow, and greedy output changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_loop import greedy_generate, hf_greedy
from step_cases import prompts
from test_model_families import assert_last_logits_close
from tiny_models import TINY_LIMITS, tiny_config, write_gguf, write_hf_checkpoint
from transformers import AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.errors import UnsupportedModelError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.sources import gguf_config, load_model, resolve_source
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

WINDOW = 8
PROMPT_LENGTHS = [5, 23, 40]  # shorter than the window, and longer
GLOBAL_ROPE = {"rope_type": "linear", "factor": 8.0}  # the 4B-27B's global layers


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six layers, llama.cpp's pattern (five local, then one global); the attention scale 24 ** -0.5,
    not head_dim's (16), so it is read rather than assumed."""
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "gemma3_text",
        seed=3,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        rope_scaling=GLOBAL_ROPE,
    )


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory, gemma_dir: Path) -> Path:
    """As llama.cpp writes Gemma 3 (norms stored as 1 + w, linear RoPE scaling keys), Q8_0 blocks."""
    path = tmp_path_factory.mktemp("tiny-gemma3-gguf") / "tiny-gemma3-q8_0.gguf"
    return write_gguf(path, gemma_dir, linear_type="Q8_0", embed_type="Q8_0")


def _build(source: Path, output: Path) -> Path:
    build_engine(source, output, BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    return output


@pytest.fixture(scope="module")
def folder_engine(tmp_path_factory: pytest.TempPathFactory, gemma_dir: Path) -> Path:
    return _build(gemma_dir, tmp_path_factory.mktemp("engines") / "gemma3-fp32")


@pytest.fixture(scope="module")
def gguf_engine(tmp_path_factory: pytest.TempPathFactory, gemma_gguf: Path) -> Path:
    return _build(gemma_gguf, tmp_path_factory.mktemp("engines") / "gemma3-q8_0")


def _gguf_oracle(path: Path) -> torch.nn.Module:
    """transformers' Gemma3ForCausalLM on the GGUF's weights as its GGUF loader dequantizes them
    (it takes the stored 1 off the norms too), with the config the builder reads."""
    loaded = load_model(resolve_source(path))
    model = AutoModelForCausalLM.from_config(loaded.hf_config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict)
    return model.eval()


def _assert_greedy_equals(engine: Engine, hf: torch.nn.Module) -> None:
    for prompt in prompts(engine.config.spec.vocab_size, PROMPT_LENGTHS, seed=7):
        expected = hf_greedy(hf, prompt, 20)
        assert greedy_generate(engine, prompt, 20) == expected
        for chunk in (3, WINDOW + 1, 16):  # chunks that start inside, at and past a window
            assert greedy_generate(engine, prompt, 20, chunk=chunk) == expected, chunk
        assert_last_logits_close(engine, hf, prompt)
        assert_last_logits_close(engine, hf, prompt + expected)  # 20 decodes on, deeper past the window


def test_the_spec_read_from_a_folder_and_from_a_gguf(gemma_dir: Path, gemma_gguf: Path) -> None:
    """transformers' config and llama.cpp's header give the same Gemma 3 spec, but for the
    attention scale, which llama.cpp takes from head_dim (query_pre_attn_scalar = 256 = head_dim
    in the 1B-12B)."""
    from transformers import AutoConfig

    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(gemma_dir))
    assert spec.architecture == "gemma3_text" and spec.tie_word_embeddings and spec.qk_norm
    assert (spec.sliding_window, spec.full_attention_layers) == (WINDOW, (5,))
    assert [spec.layer_window(i) for i in range(6)] == [WINDOW] * 5 + [None]
    assert (spec.local_rope_theta, spec.hidden_act, spec.norm_weight_offset) == (10000.0, "gelu_pytorch_tanh", 1.0)
    assert (spec.embed_scale, spec.sandwich_norms, spec.attention_scale) == (8.0, True, 24**-0.5)
    config = gguf_config(gemma_gguf)
    assert config.rope_parameters["full_attention"]["rope_type"] == "linear"
    from_gguf = model_spec_from_hf_config(config)
    assert from_gguf.attention_scale == 16**-0.5
    assert from_gguf.rms_norm_eps == pytest.approx(spec.rms_norm_eps)  # stored as f32 in the file
    same = dict(attention_scale=spec.attention_scale, rms_norm_eps=spec.rms_norm_eps)
    assert from_gguf.to_json() | same == spec.to_json()


def test_folder_engine_equals_transformers(gemma_dir: Path, folder_engine: Path) -> None:
    """Dense fp32 engine (SDPA context path, masked decode path): local layers windowed, the
    global one not, each with its own RoPE; max_seq_len 256 = 32 windows."""
    engine = Engine.load(folder_engine, StepMode.COMPILED)
    assert engine.config.spec.full_attention_layers == (5,)
    _assert_greedy_equals(engine, AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval())


def test_gguf_engine_keeps_blocks_and_equals_transformers_gguf_loader(gemma_gguf: Path, gguf_engine: Path) -> None:
    """Q8_0 engine: both attention paths in the decode kernel (windowed op on local layers, the
    plain one on the global layer); the norms' stored 1 is taken off once."""
    config = EngineConfig.load(gguf_engine)
    assert config.kernels is not None and set(config.weight_formats.values()) == {"q8_0"}
    _assert_greedy_equals(Engine.load(gguf_engine, StepMode.COMPILED), _gguf_oracle(gemma_gguf))


def _last_logits(engine: Engine, steps: list[list[RequestSlice]]) -> torch.Tensor:
    """Run `steps` from an empty cache; the last step's logits."""
    engine.kv_cache.zero_()
    for step in steps:
        logits = engine.step(build_step_inputs(step, engine.config.limits.block_size))
    return logits


def test_logits_are_bitwise_batch_and_chunk_invariant(gemma_gguf: Path, gguf_engine: Path) -> None:
    """A prompt's last logits, bit for bit: alone; beside other prompts and a decode deep past
    the window; prefilled in two chunks split around window edges. Alone, transformers'."""
    engine = Engine.load(gguf_engine, StepMode.COMPILED)
    texts = prompts(engine.config.spec.vocab_size, [40, 23, 37, 90], seed=9)
    hf = _gguf_oracle(gemma_gguf)
    tables = [[30, 4, 17], [9, 22], [41, 1, 33], list(range(10, 16))]
    whole = [RequestSlice(text, 0, table, True) for text, table in zip(texts[:3], tables, strict=False)]
    alone = [_last_logits(engine, [[piece]])[0] for piece in whole]
    long_prefill = RequestSlice(texts[3], 0, tables[3], True)
    decode = RequestSlice([7], len(texts[3]), tables[3], True)  # 91 keys, window 8
    beside = _last_logits(engine, [[long_prefill], [*whole[::-1], decode]])
    assert torch.equal(beside[3], _last_logits(engine, [[long_prefill], [decode]])[0])
    for row, (text, table) in enumerate(zip(texts[:3], tables, strict=False)):
        with torch.no_grad():
            expected = hf(torch.tensor([text])).logits[0, -1]
        assert torch.allclose(alone[row], expected, atol=2e-5, rtol=0), row
        assert torch.equal(beside[2 - row], alone[row]), f"prompt {row} batched"
        for split in (1, WINDOW - 1, WINDOW, WINDOW + 1, 16, 17, len(text) - 1):
            head, tail = RequestSlice(text[:split], 0, table, False), RequestSlice(text[split:], split, table, True)
            assert torch.equal(_last_logits(engine, [[head], [tail]])[0], alone[row]), f"prompt {row} split {split}"


def test_compiled_eager_and_reference_paths_agree(folder_engine: Path, gguf_engine: Path) -> None:
    """One mixed step (a chunk past the window over cached context, a whole prompt, a deep
    decode) in the three step modes of both engines."""
    vocab = EngineConfig.load(gguf_engine).spec.vocab_size
    a, b, c = prompts(vocab, [30, 19, 50], seed=13)
    warmup = [RequestSlice(a[:16], 0, [3, 17], False), RequestSlice(c, 0, [25, 11, 30, 7], True)]
    mixed = [
        RequestSlice(a[16:], 16, [3, 17], True),
        RequestSlice(b, 0, [40, 2], True),
        RequestSlice([5], 50, [25, 11, 30, 7], True),
    ]
    for folder in (folder_engine, gguf_engine):
        results = {mode: _last_logits(Engine.load(folder, mode), [warmup, mixed]) for mode in StepMode}
        for mode in (StepMode.REFERENCE, StepMode.EAGER):
            assert (results[mode] - results[StepMode.COMPILED]).abs().max().item() < 1e-5, (folder.name, mode)


@pytest.mark.parametrize("field", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_softcapping_is_refused_naming_it(field: str) -> None:
    """Gemma 2's softcaps (None in every Gemma 3) are not implemented: refused, not ignored."""
    with pytest.raises(UnsupportedModelError, match=field):
        model_spec_from_hf_config(tiny_config("gemma3_text", 320, **{field: 30.0}))


def test_layer_types_decide_the_windows_and_rope_tables() -> None:
    """Any pattern of layer_types: global layers take no window and the global RoPE; with no
    global layer every layer slides on the one (local) table; with no local layer, no window."""
    mixed = model_spec_from_hf_config(
        tiny_config(
            "gemma3_text",
            320,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=["full_attention", "sliding_attention", "full_attention"],
        )
    )
    assert [mixed.layer_window(i) for i in range(3)] == [None, WINDOW, None]
    assert [mixed.uses_local_rope(i) for i in range(3)] == [False, True, False]
    local = model_spec_from_hf_config(tiny_config("gemma3_text", 320, num_hidden_layers=2, sliding_window_pattern=3))
    assert (local.sliding_window, local.full_attention_layers, local.local_rope_theta) == (4096, (), None)
    dense = tiny_config("gemma3_text", 320, num_hidden_layers=2, layer_types=["full_attention"] * 2)
    spec = model_spec_from_hf_config(dense)
    assert (spec.sliding_window, spec.local_rope_theta, spec.layer_window(0)) == (None, None, None)
