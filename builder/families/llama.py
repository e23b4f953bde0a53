"""Llama: Llama 2/3.x, SmolLM/SmolLM2, TinyLlama; the family every default in family.py is.

llama.cpp writes Llama as arch `llama` with attn_q/attn_k rows permuted for its rotary layout, Llama
3's `llama3` RoPE scaling as the tensor `rope_freqs.weight` (one factor per rotary pair, no key),
and Mistral as `llama` too: a `llama` file that declares a window is read as the Mistral it is,
and Mixtral: one with `llama.expert_count` is read by the Mixtral family (mixtral.py).
"""

from __future__ import annotations

from typing import Any

from ifb.builder.families.family import Family, gguf_window
from ifb.builder.gguf_metadata import field_value

# Llama's config fields that a Mistral config would not take as they are
_NOT_MISTRAL_FIELDS = ("model_type", "architectures", "sliding_window")


class Llama(Family):
    model_type = "llama"
    gguf_architecture = "llama"
    releases = "Llama 2/3.x, SmolLM/SmolLM2, TinyLlama"
    config_attention_bias = True
    config_mlp_bias = True
    gguf_permuted_qk = True
    rope_freqs = True

    def gguf_variant(self, reader: Any) -> str | None:
        """A `llama` file with experts is a Mixtral (llama.cpp's converter writes it so)."""
        return "mixtral" if field_value(reader, f"{self.gguf_name}.expert_count") else None

    def read_window(self, config: Any, reader: Any) -> Any:
        """A window in a `llama` file makes it the Mistral it is (transformers' own test, `mistral`
        in general.name, compares a list with a string and never matches)."""
        window = gguf_window(reader, self.gguf_name)
        if not window:
            return config
        from transformers import MistralConfig

        mistral = MistralConfig(**{k: v for k, v in config.to_dict().items() if k not in _NOT_MISTRAL_FIELDS})
        mistral.sliding_window = window
        return mistral
