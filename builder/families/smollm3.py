"""SmolLM3: Llama with every 4th layer's RoPE left out (NoPE).

llama.cpp writes it exactly as Llama (its converter subclasses LlamaModel: the same keys, tensor
names and permuted q/k) under arch `smollm3`, which transformers' GGUF reader does not list; it is
read with the Llama tables into SmolLM3's own config class, whose `no_rope_layers` default (every
4th layer, `no_rope_layer_interval` 4) is what llama.cpp hard-codes: the file has no key for it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ifb.builder.families.family import Family, WindowRule
from ifb.runtime.engine_format import ModelSpec


class SmolLM3(Family):
    model_type = "smollm3"
    gguf_architecture = "smollm3"
    releases = "SmolLM3-3B"
    config_attention_bias = True
    config_mlp_bias = True
    window = WindowRule.LAYER_TYPES
    gguf_permuted_qk = True
    rope_freqs = True
    llama_shaped_gguf = True

    def common_spec(self, config: Any) -> ModelSpec:
        """`no_rope_layers` is a 0/1 per layer, 1 = uses RoPE; the spec records the 0s' indices."""
        flags = getattr(config, "no_rope_layers", None) or ()
        no_rope = tuple(index for index, uses_rope in enumerate(flags) if not uses_rope)
        return replace(super().common_spec(config), no_rope_layers=no_rope)
