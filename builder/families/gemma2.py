"""Gemma 2: interleaved local (sliding-window) and global layers, GeGLU, (1 + w) RMSNorms, a
sandwich of four norms per layer, embeddings scaled by sqrt(hidden), soft-capped attention scores
and final logits. Gemma 3 (gemma3.py) is this family plus q/k norms and a second RoPE base.

llama.cpp's converter stores every norm weight as (1 + w), the scale its graph multiplies by (the
network adds the 1 itself: ModelSpec.norm_weight_offset), and the sandwich's output norms as
post_attention_norm / post_ffw_norm (ffn_norm stays the MLP's input norm).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import Family, VocabularyStyle, checked_window, sliding_layers
from ifb.builder.gguf_metadata import field_value
from ifb.runtime.engine_format import Activation, ModelSpec

# Gemma 3's four norms: post_attention_layernorm norms the attention's output, pre_feedforward the MLP's input
HF_SANDWICH_NORMS = {
    "input_norm": "input_layernorm",
    "attn_out_norm": "post_attention_layernorm",
    "post_norm": "pre_feedforward_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}
GGUF_SANDWICH_NORMS = {
    "input_norm": "attn_norm",
    "post_norm": "ffn_norm",
    "attn_out_norm": "post_attention_norm",
    "mlp_out_norm": "post_ffw_norm",
}


class Gemma2(Family):
    model_type = "gemma2"
    gguf_architecture = "gemma2"
    releases = "Gemma 2 2B/9B/27B"
    config_attention_bias = True
    gguf_keys = ("attn_logit_softcapping", "final_logit_softcapping")
    gguf_norm_offset = 1.0
    vocabulary = VocabularyStyle.GEMMA
    hf_layer_norms = HF_SANDWICH_NORMS
    gguf_layer_norms = GGUF_SANDWICH_NORMS
    # llama.cpp's layer count of the 27B release, whose attention scale is hidden/heads, not head_dim
    layers_of_27b: ClassVar[int] = 46
    softcaps_in_gguf: ClassVar[tuple[str, ...]] = ("attn_logit_softcapping", "final_logit_softcapping")

    def model_spec(self, config: Any) -> ModelSpec:
        """transformers' Gemma2Model/Gemma3TextModel: soft-capping where the config sets it (every
        Gemma 2; None in Gemma 3's releases). Refuses what the network does not apply."""
        if getattr(config, "use_bidirectional_attention", False):
            raise UnsupportedModelError(f"{self.model_type} use_bidirectional_attention is not supported (causal only)")
        activation = getattr(config, "hidden_activation", None) or Activation.GELU_TANH.value
        if activation != Activation.GELU_TANH:
            raise UnsupportedModelError(
                f"{self.model_type} hidden_activation {activation!r} is not supported; only 'gelu_pytorch_tanh'"
            )
        spec = self.common_spec(config)
        sliding = sliding_layers(config)
        window = checked_window(config, config.sliding_window) if sliding else None
        full = tuple(i for i in range(spec.num_layers) if i not in sliding)
        return replace(
            spec,
            sliding_window=window,
            full_attention_layers=full if window is not None else (),
            local_rope_theta=self.local_rope_theta(config, sliding, full),
            hidden_act=Activation.GELU_TANH,
            norm_weight_offset=1.0,
            embed_scale=float(spec.hidden_size) ** 0.5,
            sandwich_norms=True,
            attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
            attn_logit_softcap=_softcap(config, "attn_logit_softcapping"),
            final_logit_softcap=_softcap(config, "final_logit_softcapping"),
        )

    def local_rope_theta(self, config: Any, sliding: list[int], full: tuple[int, ...]) -> float | None:
        """Gemma 2's local layers rotate as its global ones: one table."""
        return None

    def read_gguf(self, config: Any, reader: Any) -> Any:
        self.read_attention_scale(config)
        for field in self.softcaps_in_gguf:
            # transformers' GGUF reader maps neither cap and leaves the config class's defaults (50,
            # 30: the released values, but not necessarily the file's); absent: none
            value = field_value(reader, f"{self.gguf_name}.{field}")
            setattr(config, field, float(value) if value is not None else None)
        return super().read_gguf(config, reader)

    def read_attention_scale(self, config: Any) -> None:
        """llama.cpp's attention scale, which transformers' GGUF reader leaves at the config's default
        query_pre_attn_scalar (256): head_dim ** -0.5, or (hidden/heads) ** -0.5 for the 27B."""
        if config.num_hidden_layers == self.layers_of_27b:
            config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
        else:
            config.query_pre_attn_scalar = config.head_dim


def _softcap(config: Any, field: str) -> float | None:
    value = getattr(config, field, None)
    if value is None:
        return None
    if float(value) <= 0:
        raise UnsupportedModelError(f"{config.model_type} {field} must be > 0 (or null: none), got {value}")
    return float(value)
