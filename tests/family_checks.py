"""The checks every model family's end-to-end tests make against transformers, written once.

A family test builds a tiny engine from an HF folder or from llama.cpp's own conversion of one
(tests/llama_cpp_converter.py), then asks: is greedy output transformers' on the HF folder (whole
and chunked), are the last logits within a tolerance of its (2e-5 absolute unless a test passes
its own), and (on a block-quantized engine) are a prompt's logits bitwise the same alone, batched
and chunked. For a Q8_0 file the oracle's 2-D weights are rounded as the file rounds them
(`rounded_as`); a GGUF is never read through our own code on the oracle's side.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from greedy_loop import greedy_generate, hf_greedy, scattered_blocks
from step_cases import prompts
from tiny_models import TINY_LIMITS
from transformers import AutoConfig, AutoModelForCausalLM

from ifb.builder.build import BuildOptions, build_engine
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs


def build_fp32(source: Path, output: Path) -> Path:
    """A tiny fp32 engine (block formats a GGUF holds are kept) at TINY_LIMITS."""
    build_engine(source, output, BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    return output


def oracle(folder: Path, **config_overrides: object) -> torch.nn.Module:
    """transformers on the HF folder (optionally with its config changed), fp32, eval."""
    config = AutoConfig.from_pretrained(folder)
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32).eval()


def rounded_as(model: torch.nn.Module, gguf_path: Path) -> torch.nn.Module:
    """`model` with every 2-D weight rounded through Q8_0 as gguf-py rounds it, after checking
    that the file at `gguf_path` stores every 2-D tensor as Q8_0 (so these are its roundings:
    Q8_0 blocks run along a row, which llama.cpp's q/k row permutation leaves whole)."""
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


def oracle_last_logits(hf: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0, -1]


def assert_last_logits_close(engine: Engine, hf: torch.nn.Module, prompt: list[int], atol: float = 2e-5) -> None:
    """The prompt's next-token logits within `atol` of transformers' (fp32 both; a wrong RoPE
    factor moves them by ~2e-3 here)."""
    table = scattered_blocks(engine, len(prompt))
    ours = engine.step(
        build_step_inputs([RequestSlice(prompt, 0, table, sample=True)], engine.config.limits.block_size)
    )
    theirs = oracle_last_logits(hf, prompt)
    assert torch.allclose(ours[0], theirs, atol=atol, rtol=0), (ours[0] - theirs).abs().max()


def assert_greedy_equals(
    engine: Engine,
    hf: torch.nn.Module,
    prompt_lengths: Sequence[int],
    new_tokens: int,
    chunks: Sequence[int] = (),
    deep: bool = False,
    atol: float = 2e-5,
) -> None:
    """For each prompt: greedy output equals transformers', whole and prefilled in each chunk
    size; the last logits are close; with `deep`, also those of prompt + output (decodes on)."""
    for prompt in prompts(engine.config.spec.vocab_size, list(prompt_lengths), seed=7):
        expected = hf_greedy(hf, prompt, new_tokens)
        assert greedy_generate(engine, prompt, new_tokens) == expected
        for chunk in chunks:
            assert greedy_generate(engine, prompt, new_tokens, chunk=chunk) == expected, chunk
        assert_last_logits_close(engine, hf, prompt, atol)
        if deep:
            assert_last_logits_close(engine, hf, prompt + expected, atol)


def last_logits(engine: Engine, steps: list[list[RequestSlice]]) -> torch.Tensor:
    """Run `steps` from an empty cache; the last step's logits."""
    engine.kv_cache.zero_()
    for step in steps:
        logits = engine.step(build_step_inputs(step, engine.config.limits.block_size))
    return logits


BITWISE_TABLES = [[30, 4, 17], [9, 22], [41, 1, 33], list(range(10, 16))]


def assert_bitwise_invariant(engine: Engine, hf: torch.nn.Module, window: int, atol: float = 2e-5) -> None:
    """Prompts of 40, 23 and 37 tokens and a 90-token one: each of the first three's last
    logits, bit for bit, alone; beside the others and a decode deep past the window; prefilled
    in two chunks split around window edges; after a reused prefix (the first one's first two
    blocks written by another request, whose table it shares). Alone they are transformers' within
    `atol` (so a difference applied everywhere alike fails too), and so is the deep decode."""
    texts = prompts(engine.config.spec.vocab_size, [40, 23, 37, 90], seed=9)
    whole = [RequestSlice(text, 0, table, True) for text, table in zip(texts[:3], BITWISE_TABLES, strict=False)]
    alone = [last_logits(engine, [[piece]])[0] for piece in whole]
    long_text, long_table = texts[3], BITWISE_TABLES[3]
    long_prefill = RequestSlice(long_text, 0, long_table, True)
    decode = RequestSlice([7], len(long_text), long_table, True)  # 91 keys
    beside = last_logits(engine, [[long_prefill], [*whole[::-1], decode]])
    decode_alone = last_logits(engine, [[long_prefill], [decode]])[0]
    assert torch.equal(beside[3], decode_alone)
    assert torch.allclose(decode_alone, oracle_last_logits(hf, [*long_text, 7]), atol=atol, rtol=0)
    for row, (text, table) in enumerate(zip(texts[:3], BITWISE_TABLES, strict=False)):
        assert torch.allclose(alone[row], oracle_last_logits(hf, text), atol=atol, rtol=0), row
        assert torch.equal(beside[2 - row], alone[row]), f"prompt {row} batched"
        for split in (1, window - 1, window, window + 1, 16, 17, len(text) - 1):
            head, tail = RequestSlice(text[:split], 0, table, False), RequestSlice(text[split:], split, table, True)
            assert torch.equal(last_logits(engine, [[head], [tail]])[0], alone[row]), f"prompt {row} split {split}"
    shared = [5, 6]
    donor = RequestSlice(texts[0][:32] + texts[1][:5], 0, [*shared, 7], True)
    reused = RequestSlice(texts[0][32:], 32, [*shared, 44], True)
    assert torch.equal(last_logits(engine, [[donor], [reused]])[0], alone[0]), "after a reused prefix"


def assert_step_modes_agree(
    folder: Path, hf: torch.nn.Module | None = None, atol: float = 2e-5, modes_atol: float = 1e-5
) -> None:
    """One mixed step (a chunk past an 8-wide window over cached context, a whole prompt, a deep
    decode) in the three step modes of the engine at `folder`: reference loops, eager and
    compiled agree within `modes_atol`; with `hf`, the reference's logits are transformers'
    (within `atol`)."""
    a, b, c = prompts(EngineConfig.load(folder).spec.vocab_size, [30, 19, 50], seed=13)
    warmup = [RequestSlice(a[:16], 0, [3, 17], False), RequestSlice(c, 0, [25, 11, 30, 7], True)]
    mixed = [
        RequestSlice(a[16:], 16, [3, 17], True),
        RequestSlice(b, 0, [40, 2], True),
        RequestSlice([5], 50, [25, 11, 30, 7], True),
    ]
    results = {mode: last_logits(Engine.load(folder, mode), [warmup, mixed]) for mode in StepMode}
    for mode in (StepMode.REFERENCE, StepMode.EAGER):
        error = (results[mode] - results[StepMode.COMPILED]).abs().max().item()
        assert error < modes_atol, (folder.name, mode, error)
    if hf is not None:
        expected = torch.stack([oracle_last_logits(hf, ids) for ids in (a, b, [*c, 5])])
        assert torch.allclose(results[StepMode.REFERENCE], expected, atol=atol, rtol=0), folder.name
