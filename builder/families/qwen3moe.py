"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in every layer a mixture of
SwiGLU experts in place of the MLP: a router's softmax over the experts, the top
`num_experts_per_tok` of it (renormalized to sum 1 where `norm_topk_prob`), no shared expert.

What the network does not implement is refused by name: dense MLP layers among the MoE ones
(`mlp_only_layers`, `decoder_sparse_step` > 1), as no released Qwen3-MoE has them.
"""

from __future__ import annotations

from typing import Any

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import HF_LAYER_NORMS, WindowRule
from ifb.builder.families.routed_experts import EXPERT_COUNT_KEYS, RoutedExperts
from ifb.builder.gguf_metadata import field_value
from ifb.runtime.engine_format import ModelSpec


class Qwen3Moe(RoutedExperts):
    model_type = "qwen3_moe"
    gguf_architecture = "qwen3moe"
    releases = "Qwen3-30B-A3B, Qwen3-235B-A22B (mixtures of experts)"
    config_attention_bias = True
    qk_norm = True
    # Qwen3MoeConfig keeps sliding_window only where use_sliding_window is set, and its attention
    # then applies it on every layer
    window = WindowRule.EVERY_LAYER
    hf_layer_norms = {**HF_LAYER_NORMS, "mlp.router": "mlp.gate"}
    hf_layer_experts = {
        "mlp.experts_gate_up": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
        "mlp.experts_down": ("mlp.experts.{e}.down_proj",),
    }
    gguf_keys = (*EXPERT_COUNT_KEYS, "expert_feed_forward_length")

    def model_spec(self, config: Any) -> ModelSpec:
        dense_layers = list(getattr(config, "mlp_only_layers", None) or [])
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        if dense_layers or step != 1:
            raise UnsupportedModelError(
                "qwen3_moe with dense MLP layers among the expert ones is not supported "
                f"(mlp_only_layers={dense_layers}, decoder_sparse_step={step}; every layer must be MoE)"
            )
        return super().model_spec(config)

    def read_gguf(self, config: Any, reader: Any) -> Any:
        """The experts' width, which transformers' GGUF reader does not map (it leaves
        Qwen3MoeConfig's 768), and norm_topk_prob: llama.cpp's qwen3moe graph always renormalizes."""
        config = super().read_gguf(config, reader)
        width = field_value(reader, f"{self.gguf_name}.expert_feed_forward_length")
        if width is None:
            raise UnsupportedModelError(f"GGUF {self.gguf_name} file lacks {self.gguf_name}.expert_feed_forward_length")
        config.moe_intermediate_size = int(width)
        config.norm_topk_prob = True
        return config
