"""The engine's rotary inverse frequencies and cos/sin scale, as transformers computes them for the
model's own class (its family's `rope_init`), with llama.cpp's per-pair RoPE factors (a GGUF's
`rope_freqs`) applied."""

from __future__ import annotations

from typing import Any

import torch

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families import family_of


def rope_tables(hf_config: Any, max_seq_len: int) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling from transformers' own RoPE init (llama3/yarn/longrope/...
    scaling, builder/families/family.py `Family.rope_init`). A GGUF's `rope_freqs` factors (read by
    the family: `rope_freq_factors`) divide the result, as llama.cpp's graph divides its frequencies
    by them."""
    inv_freq, attention = family_of(hf_config.model_type).rope_init(hf_config, max_seq_len)
    inv_freq = inv_freq.float().clone()
    factors = getattr(hf_config, "rope_freq_factors", None)
    if factors is not None:
        if len(factors) != inv_freq.shape[0]:
            raise UnsupportedModelError(
                f"GGUF rope_freqs has {len(factors)} factors; the model rotates {inv_freq.shape[0]} pairs"
            )
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, float(attention)
