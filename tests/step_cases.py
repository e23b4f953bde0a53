"""Step cases shared by the engine tests of every backend: seeded prompts and a mixed step."""

from __future__ import annotations

import torch

from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

FP32_TOLERANCE = 2e-4  # max abs logit difference, fp32, logits of magnitude ~1-10


def prompts(vocab: int, lengths: list[int], seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def mixed_step_slices(engine: Engine) -> tuple[list[RequestSlice], list[RequestSlice]]:
    """Warm-up slices that fill some context, then one step mixing chunks and decodes."""
    vocab = engine.config.spec.vocab_size
    a, b, c, d = prompts(vocab, [20, 9, 33, 5], seed=11)
    tables = [[3, 17, 9], [40, 2], [25, 11, 30, 7], [46]]
    warmup = [
        RequestSlice(a[:16], 0, tables[0], False),  # a: first chunk already computed
        RequestSlice(c, 0, tables[2], True),  # c: fully prefilled, will decode
        RequestSlice(d, 0, tables[3], True),  # d: fully prefilled, will decode
    ]
    mixed = [
        RequestSlice([5], 33, tables[2], True),  # decode c at position 33
        RequestSlice(a[16:], 16, tables[0], True),  # a: last chunk over cached context
        RequestSlice(b, 0, tables[1], True),  # b: whole prompt in one chunk
        RequestSlice([7], 5, tables[3], True),  # decode d
    ]
    return warmup, mixed


def run_mixed_step(engine: Engine) -> torch.Tensor:
    """The warm-up step, then the mixed step; returns the mixed step's logits (on the host)."""
    warmup, mixed = mixed_step_slices(engine)
    block_size = engine.config.limits.block_size
    engine.step(build_step_inputs(warmup, block_size))
    return engine.step(build_step_inputs(mixed, block_size))
