"""Mistral: Llama's layer with a sliding window on every layer (4096 in 7B v0.1, none later).

llama.cpp's converter writes it as arch `llama` (permuted q/k rows, `attention.sliding_window`),
so its files are read by the Llama family, which hands them here when they declare a window.
"""

from __future__ import annotations

from typing import Any

from ifb.builder.families.family import Family, WindowRule

_NOT_LLAMA_FIELDS = ("model_type", "architectures", "sliding_window")


class Mistral(Family):
    model_type = "mistral"
    gguf_architecture = None  # written as `llama`
    releases = "Mistral 7B v0.1-v0.3, Mistral Nemo"
    window = WindowRule.EVERY_LAYER
    gguf_permuted_qk = True

    def transformers_load_config(self, config: Any) -> Any:
        """transformers' GGUF loader maps no mistral tensors: read as the Llama it is."""
        from transformers import LlamaConfig

        return LlamaConfig(**{k: v for k, v in config.to_dict().items() if k not in _NOT_LLAMA_FIELDS})
