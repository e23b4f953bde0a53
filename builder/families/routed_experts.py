"""RoutedExperts: the base of the families whose every layer's MLP is a mixture of SwiGLU experts
(runtime/step/moe_block.py): a router (a dense linear, no bias) whose softmax over the experts
picks the top `num_experts_per_tok`, renormalized to sum 1 where the spec's norm_topk_prob says;
no shared expert, no dense MLP layer. Qwen3-MoE, OLMoE and Mixtral differ in the config fields
that say so, the tensors' names and whether the top-k is renormalized; the rest is here once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import GGUF_LAYER_LINEARS, GGUF_LAYER_NORMS, HF_LAYER_LINEARS, Family
from ifb.runtime.engine_format import ModelSpec

# The attention's linears only: the experts replace the dense MLP
ATTENTION_LINEARS_HF = {k: v for k, v in HF_LAYER_LINEARS.items() if k.startswith("attn.")}
ATTENTION_LINEARS_GGUF = {k: v for k, v in GGUF_LAYER_LINEARS.items() if k.startswith("attn.")}
# The router is a per-layer dense weight read as the norms are; llama.cpp's converter writes it
# as `ffn_gate_inp` and the experts stacked, [experts, rows, cols] each, for every such family
ROUTER_GGUF = {**GGUF_LAYER_NORMS, "mlp.router": "ffn_gate_inp"}
EXPERTS_GGUF = {
    "mlp.experts_gate_up": ("ffn_gate_exps", "ffn_up_exps"),
    "mlp.experts_down": ("ffn_down_exps",),
}
EXPERT_COUNT_KEYS = ("expert_count", "expert_used_count")


class RoutedExperts(Family):
    hf_layer_linears = ATTENTION_LINEARS_HF
    gguf_layer_linears = ATTENTION_LINEARS_GGUF
    gguf_layer_norms = ROUTER_GGUF
    gguf_layer_experts = EXPERTS_GGUF
    gguf_keys = EXPERT_COUNT_KEYS

    # the config's fields: how many experts, and one expert's intermediate width
    num_experts_field: ClassVar[str] = "num_experts"
    expert_width_field: ClassVar[str] = "moe_intermediate_size"

    def model_spec(self, config: Any) -> ModelSpec:
        spec = super().model_spec(config)
        num_experts = int(getattr(config, self.num_experts_field, 0) or 0)
        top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise UnsupportedModelError(
                f"{self.model_type} needs {self.num_experts_field} >= 1 and 1 <= num_experts_per_tok <= "
                f"{self.num_experts_field}, got {self.num_experts_field}={num_experts}, num_experts_per_tok={top_k}"
            )
        return replace(
            spec,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(getattr(config, self.expert_width_field)),
            norm_topk_prob=self.norm_topk_prob(config),
        )

    def norm_topk_prob(self, config: Any) -> bool:
        """Whether the top-k probabilities are renormalized to sum 1 (the config's flag by default)."""
        return bool(getattr(config, "norm_topk_prob", False))
