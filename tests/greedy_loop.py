"""A minimal greedy loop straight over Engine.step, with deliberately scattered KV blocks."""

from __future__ import annotations

import math

import torch

from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs


def scattered_blocks(engine: Engine, num_tokens: int, stride: int = 7) -> list[int]:
    """Non-contiguous, out-of-order block ids covering `num_tokens`."""
    total = engine.config.limits.num_kv_blocks
    needed = math.ceil(num_tokens / engine.config.limits.block_size)
    return [(total - 1 - i * stride) % total for i in range(needed)]


def greedy_generate(engine: Engine, prompt: list[int], max_new_tokens: int, chunk: int | None = None) -> list[int]:
    """Prefill (optionally in chunks of `chunk` tokens), then decode one token per step."""
    block_size = engine.config.limits.block_size
    table = scattered_blocks(engine, len(prompt) + max_new_tokens)
    chunk = chunk or len(prompt)
    start = 0
    logits = None
    while start < len(prompt):
        piece = prompt[start : start + chunk]
        inputs = build_step_inputs([RequestSlice(piece, start, table, sample=True)], block_size)
        logits = engine.step(inputs)
        start += len(piece)
    assert logits is not None
    out = [int(logits[0].argmax())]
    while len(out) < max_new_tokens:
        position = len(prompt) + len(out) - 1
        inputs = build_step_inputs([RequestSlice([out[-1]], position, table, sample=True)], block_size)
        out.append(int(engine.step(inputs)[0].argmax()))
    return out


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt` (no EOS stop): the oracle's tokens."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()
