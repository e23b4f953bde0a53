"""Qwen3 dense (0.6B-32B): Llama's layer with each head's q and k RMS-normalized before RoPE, no
bias unless `attention_bias`; YaRN (`rope.scaling.*` keys in a GGUF) is how it runs past 32k."""

from __future__ import annotations

from ifb.builder.families.family import Family, WindowRule


class Qwen3(Family):
    model_type = "qwen3"
    gguf_architecture = "qwen3"
    releases = "Qwen3 0.6B-32B (dense)"
    config_attention_bias = True
    qk_norm = True
    window = WindowRule.LAYER_TYPES
    rope_freqs = True
