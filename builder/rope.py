"""The engine's rotary inverse frequencies and cos/sin scale, as transformers computes them for the
model's own class, with llama.cpp's per-pair RoPE factors (a GGUF's `rope_freqs`) applied."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.hf_config import GEMMA3, gemma3_global_layer_type


def rope_tables(hf_config: Any, max_seq_len: int) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling from transformers' own RoPE init (llama3/yarn/longrope/...
    scaling). Plain RoPE comes from the family's own rotary class, so Phi-3's
    partial_rotary_factor shortens the table as it does there (Llama's ignores the factor).
    LongRoPE (Phi-3) takes its long factors for an engine whose max_seq_len passes
    original_max_position_embeddings, for every position, as llama.cpp does for such a context:
    transformers switches per call by the sequence's length, so on prompts shorter than the
    original window such an engine differs from it (the short factors apply there). A GGUF's
    `rope_freqs` factors (sources.gguf_config: `rope_freq_factors`) divide the result, as
    llama.cpp's graph divides its frequencies by them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if hf_config.model_type == GEMMA3:
        inv_freq, attention = _gemma3_rope_tables(hf_config)
    else:
        rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type == "default":
            inv_freq, attention = _rotary_class(hf_config).compute_default_rope_parameters(hf_config)
        elif rope_type == "longrope":
            inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](hf_config, None, seq_len=max_seq_len)
        else:
            inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    inv_freq = inv_freq.float().clone()
    factors = getattr(hf_config, "rope_freq_factors", None)
    if factors is not None:
        if len(factors) != inv_freq.shape[0]:
            raise UnsupportedModelError(
                f"GGUF rope_freqs has {len(factors)} factors; the model rotates {inv_freq.shape[0]} pairs"
            )
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, float(attention)


def _rotary_class(hf_config: Any) -> Any:
    """The family's transformers rotary-embedding class (LlamaRotaryEmbedding, Phi3RotaryEmbedding, ...)."""
    model_type = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    classes = [
        value
        for name, value in vars(module).items()
        if name.endswith("RotaryEmbedding") and hasattr(value, "compute_default_rope_parameters")
    ]
    if len(classes) != 1:
        raise UnsupportedModelError(f"cannot tell {model_type}'s rotary embedding in transformers: {classes}")
    return classes[0]


def _gemma3_rope_tables(hf_config: Any) -> tuple[torch.Tensor, float]:
    """Gemma 3's global layers' inv_freq and scaling (their rope_theta, rope_scaling where set),
    by transformers' own init; its local layers' table comes from ModelSpec.local_rope_theta."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    layer_type = gemma3_global_layer_type(hf_config)
    rope_type = hf_config.rope_parameters[layer_type].get("rope_type", "default")
    init = Gemma3RotaryEmbedding.compute_default_rope_parameters
    if rope_type != "default":
        init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, attention = init(hf_config, None, layer_type=layer_type)
    return inv_freq, float(attention)
