"""OLMoE (OLMoE-1B-7B-0924, -0125): Llama's layer with a mixture of SwiGLU experts in every layer
(64 experts, 8 per token in the released ones; router softmax -> top-k, not renormalized unless
`norm_topk_prob`) and q and k RMS-normalized before RoPE over the whole projection, all heads
together (one weight of num_heads * head_dim for q, num_kv_heads * head_dim for k), not per head.

llama.cpp's converter writes it as arch `olmoe`: q/k rows as transformers holds them (its graph
rotates the halves, as transformers does), `attn_q_norm`/`attn_k_norm` of the whole width, the
router `ffn_gate_inp` and stacked `ffn_{gate,up,down}_exps`, `olmoe.expert_count` and
`expert_used_count`, the experts' width as `feed_forward_length` (OlmoeConfig's intermediate_size
is one expert's). Its graph never renormalizes the top-k, so a file reads norm_topk_prob False.
transformers' GGUF reader does not know the name: its keys are read with the table below.
What the network does not implement is refused by name: `clip_qkv` (q, k, v clamped).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import HF_LAYER_NORMS
from ifb.builder.families.routed_experts import RoutedExperts
from ifb.runtime.engine_format import ModelSpec

# `olmoe.*` keys -> OlmoeConfig's fields, for transformers' GGUF reader (Llama's, plus the experts)
_GGUF_CONFIG_KEYS: dict[str, str | None] = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": None,
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
}


class Olmoe(RoutedExperts):
    model_type = "olmoe"
    gguf_architecture = "olmoe"
    releases = "OLMoE-1B-7B (mixture of experts)"
    config_attention_bias = True
    qk_norm = True
    gguf_config_keys = _GGUF_CONFIG_KEYS
    expert_width_field = "intermediate_size"  # OlmoeConfig's intermediate_size is one expert's
    hf_layer_norms = {**HF_LAYER_NORMS, "mlp.router": "mlp.gate"}
    hf_layer_experts = {
        "mlp.experts_gate_up": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
        "mlp.experts_down": ("mlp.experts.{e}.down_proj",),
    }

    def model_spec(self, config: Any) -> ModelSpec:
        clip = getattr(config, "clip_qkv", None)
        if clip is not None:
            raise UnsupportedModelError(f"olmoe clip_qkv={clip} (q, k and v clamped) is not supported; only None")
        spec = super().model_spec(config)
        # transformers sizes q_norm by hidden_size and k_norm by (hidden_size // heads) * kv_heads:
        # they fit the projections only where head_dim * heads == hidden_size
        if spec.head_dim * spec.num_heads != spec.hidden_size:
            raise UnsupportedModelError(
                f"olmoe with head_dim {spec.head_dim} x {spec.num_heads} heads != hidden_size {spec.hidden_size} "
                "is not supported (its q/k norms span hidden_size)"
            )
        return replace(spec, qk_norm_across_heads=True)

    def read_gguf(self, config: Any, reader: Any) -> Any:
        """norm_topk_prob False whatever the checkpoint said: llama.cpp's olmoe graph never
        renormalizes the top-k (OLMoE-1B-7B's own config says False too)."""
        config = super().read_gguf(config, reader)
        config.norm_topk_prob = False
        return config
