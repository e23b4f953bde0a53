"""Phi-3, Phi-3.5 and Phi-4-mini: fused qkv and gate_up tensors, LongRoPE, partial rotary
(Phi-4-mini rotates 3/4 of each head), a window on every layer (Phi-3 4k: 2047).

llama.cpp's converter keeps the checkpoint's fused tensors (attn_qkv, and ffn_up holding gate then
up, which its graph splits in halves), both in our row order, and stores LongRoPE's factors as the
tensors rope_factors_short/long beside `rope.scaling.original_context_length`.
"""

from __future__ import annotations

from typing import Any

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import GGUF_LAYER_LINEARS, HF_LAYER_LINEARS, Family, VocabularyStyle, WindowRule
from ifb.builder.gguf_metadata import field_value, rope_scaling_parameters

LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class Phi3(Family):
    model_type = "phi3"
    gguf_architecture = "phi3"
    releases = "Phi-3, Phi-3.5, Phi-4-mini"
    window = WindowRule.EVERY_LAYER
    vocabulary = VocabularyStyle.PHI3
    config_tensors = LONGROPE_TENSORS
    hf_layer_linears = {**HF_LAYER_LINEARS, "attn.qkv": ("self_attn.qkv_proj",), "mlp.gate_up": ("mlp.gate_up_proj",)}
    gguf_layer_linears = {**GGUF_LAYER_LINEARS, "attn.qkv": ("attn_qkv",), "mlp.gate_up": ("ffn_up",)}

    def read_rotary_dims(self, config: Any, reader: Any) -> None:
        """Partial rotary as transformers' Phi3 takes it: `partial_rotary_factor` of the head."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dims = field_value(reader, "phi3.rope.dimension_count")
        if dims is not None and int(dims) != head_dim:
            config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": int(dims) / head_dim}

    def read_rope_scaling(self, config: Any, reader: Any) -> None:
        """LongRoPE's factors from their tensors; any other scaling from the keys."""
        factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
        original = field_value(reader, "phi3.rope.scaling.original_context_length")
        if factors and (set(factors) != set(LONGROPE_TENSORS) or original is None):
            raise UnsupportedModelError(
                f"GGUF LongRoPE needs {' and '.join(LONGROPE_TENSORS)} and phi3.rope.scaling.original_context_length; "
                f"the file has {', '.join(sorted(factors))} and original_context_length={original}"
            )
        rope = {**config.rope_parameters, **rope_scaling_parameters(reader, "phi3", also=("longrope",))}
        if factors:
            rope.update(
                rope_type="longrope",
                short_factor=[float(x) for x in factors["rope_factors_short.weight"].data],
                long_factor=[float(x) for x in factors["rope_factors_long.weight"].data],
                original_max_position_embeddings=int(original),
            )
            config.original_max_position_embeddings = int(original)
        config.rope_parameters = rope
