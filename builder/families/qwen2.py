"""Qwen2 and Qwen2.5 (and the DeepSeek-R1 distills of them): Llama's layer with a fixed bias on q,
k and v (none on o_proj), a window on the layers `layer_types` names where `use_sliding_window`
is set. llama.cpp writes q/k unpermuted and may store `rope_freqs.weight`."""

from __future__ import annotations

from ifb.builder.families.family import Family, WindowRule


class Qwen2(Family):
    model_type = "qwen2"
    gguf_architecture = "qwen2"
    releases = "Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen"
    qkv_bias = True
    window = WindowRule.LAYER_TYPES
    rope_freqs = True
