"""Gemma 3 text (270M-27B): Gemma 2's layer with q/k RMSNorms, no soft-cap in its releases, and
local layers that rotate by their own RoPE base (rope_local_base_freq) while the global ones (every
6th) take the stored table, with linear 8x scaling on the 4B-27B.

llama.cpp writes it as arch `gemma3`: the global layers' scaling as `rope.scaling.*`, the local
base as `rope.freq_base_swa` where it is not 10000; the local/global pattern is llama.cpp's fixed
one, which is transformers' default for the same config.
"""

from __future__ import annotations

from typing import Any

import torch

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.gemma2 import Gemma2
from ifb.builder.gguf_metadata import field_value, rope_scaling_parameters


class Gemma3(Gemma2):
    model_type = "gemma3_text"
    gguf_architecture = "gemma3"
    releases = "Gemma 3 270M-27B (text)"
    qk_norm = True
    gguf_keys = ("rope.freq_base_swa", "final_logit_softcapping")
    layers_of_27b = 62
    softcaps_in_gguf = ("final_logit_softcapping",)

    def local_rope_theta(self, config: Any, sliding: list[int], full: tuple[int, ...]) -> float | None:
        """The sliding layers' RoPE base, where both kinds of layer exist."""
        local_rope = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
        if sliding and local_rope.get("rope_type", "default") != "default":
            raise UnsupportedModelError(
                f"gemma3 sliding layers' rope_type {local_rope['rope_type']!r} is not supported; only 'default'"
            )
        return float(local_rope["rope_theta"]) if sliding and full else None

    def global_rope_parameters(self, config: Any) -> dict[str, Any]:
        """One dict per layer type: the full-attention layers', or the sliding ones' where every
        layer slides (then there is no second table)."""
        return dict((getattr(config, "rope_parameters", None) or {}).get(_global_layer_type(config)) or {})

    def rope_init(self, config: Any, max_seq_len: int) -> tuple[torch.Tensor, float]:
        """The global layers' inv_freq and scaling by transformers' own init; the local layers'
        table comes from ModelSpec.local_rope_theta."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

        layer_type = _global_layer_type(config)
        rope_type = config.rope_parameters[layer_type].get("rope_type", "default")
        init = Gemma3RotaryEmbedding.compute_default_rope_parameters
        if rope_type != "default":
            init = ROPE_INIT_FUNCTIONS[rope_type]
        inv_freq, attention = init(config, None, layer_type=layer_type)
        return inv_freq, float(attention)

    def read_rope_scaling(self, config: Any, reader: Any) -> None:
        """The global layers' scaling from `rope.scaling.*`; the local layers' base from
        `rope.freq_base_swa` where the file declares one (llama.cpp and transformers assume 10000)."""
        rope = {kind: dict(params) for kind, params in config.rope_parameters.items()}
        rope["full_attention"].update(rope_scaling_parameters(reader, "gemma3"))
        local_base = field_value(reader, "gemma3.rope.freq_base_swa")
        if local_base is not None:
            rope["sliding_attention"]["rope_theta"] = float(local_base)
        config.rope_parameters = rope


def _global_layer_type(config: Any) -> str:
    return "full_attention" if "full_attention" in (config.layer_types or ()) else "sliding_attention"
