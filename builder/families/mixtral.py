"""Mixtral (Mixtral-8x7B, 8x22B): Mistral's layer with a mixture of SwiGLU experts in every layer
(8 experts, 2 per token): the router's softmax over the top-k logits, i.e. softmax over all, top-k,
renormalized to sum 1 (transformers' MixtralForCausalLM), no shared expert; a window on every
layer where `sliding_window` is set, as Mistral.

HF checkpoints name the experts `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down)
and the router `block_sparse_moe.gate`. llama.cpp's converter writes Mixtral as arch `llama`
(q/k rows permuted as Llama's) with `llama.expert_count`/`expert_used_count`, the router
`ffn_gate_inp` and the experts stacked `ffn_{gate,up,down}_exps`; the Llama family hands such
files here (llama.py). Files of older converters held each expert as its own tensor
(`blk.N.ffn_gate.E.weight`): refused by name, as llama.cpp itself only reads them through a
compatibility path.
"""

from __future__ import annotations

import re
from typing import Any

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import HF_LAYER_NORMS, WindowRule
from ifb.builder.families.routed_experts import RoutedExperts
from ifb.builder.gguf_metadata import field_value

_PER_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
# Llama's config fields that a Mixtral config would not take as they are
_NOT_MIXTRAL_FIELDS = ("model_type", "architectures")


class Mixtral(RoutedExperts):
    model_type = "mixtral"
    gguf_architecture = None  # written as `llama`; Llama.gguf_variant hands its expert files here
    releases = "Mixtral 8x7B, 8x22B (mixtures of experts)"
    window = WindowRule.EVERY_LAYER
    gguf_permuted_qk = True
    num_experts_field = "num_local_experts"
    expert_width_field = "intermediate_size"  # MixtralConfig's intermediate_size is one expert's
    hf_layer_norms = {**HF_LAYER_NORMS, "mlp.router": "block_sparse_moe.gate"}
    hf_layer_experts = {
        "mlp.experts_gate_up": ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3"),
        "mlp.experts_down": ("block_sparse_moe.experts.{e}.w2",),
    }

    @property
    def gguf_name(self) -> str:
        return "llama"

    def norm_topk_prob(self, config: Any) -> bool:
        return True  # MixtralTopKRouter always renormalizes: softmax over the top-k logits

    def read_gguf(self, config: Any, reader: Any) -> Any:
        """The `llama` file's LlamaConfig as the MixtralConfig it is: the expert counts (which
        transformers' Llama table does not map) and the window, where declared."""
        per_expert = [t.name for t in reader.tensors if _PER_EXPERT_TENSOR.fullmatch(t.name)]
        if per_expert:
            raise UnsupportedModelError(
                f"this llama GGUF holds each expert as its own tensor ({', '.join(per_expert[:3])}, ...), as "
                "older llama.cpp converters wrote Mixtral; only stacked ffn_{gate,up,down}_exps are supported: "
                "convert it again with a current convert_hf_to_gguf.py"
            )
        from transformers import MixtralConfig

        fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_MIXTRAL_FIELDS}
        mixtral = MixtralConfig(**fields)
        mixtral.num_local_experts = int(field_value(reader, "llama.expert_count") or 0)
        mixtral.num_experts_per_tok = int(field_value(reader, "llama.expert_used_count") or 0)
        return super().read_gguf(mixtral, reader)
