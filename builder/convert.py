"""Hugging Face weights -> our network's state dict (fused q/k/v and gate/up projections)."""

from __future__ import annotations

import torch

from ifb.runtime.engine_format import ModelSpec


def hf_to_network_state_dict(hf_state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face Llama/Qwen2 state dict to ours, fusing q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {"embed.weight": hf_state["model.embed_tokens.weight"]}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        out[f"layers.{i}.attn.qkv.weight"] = torch.cat(
            [hf_state[attn + f"{name}_proj.weight"] for name in "qkv"], dim=0
        )
        if spec.attention_bias:
            out[f"layers.{i}.attn.qkv.bias"] = torch.cat(
                [hf_state[attn + f"{name}_proj.bias"] for name in "qkv"], dim=0
            )
        out[f"layers.{i}.attn.o_proj.weight"] = hf_state[attn + "o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up.weight"] = torch.cat(
            [hf_state[p + "mlp.gate_proj.weight"], hf_state[p + "mlp.up_proj.weight"]], dim=0
        )
        out[f"layers.{i}.mlp.down.weight"] = hf_state[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.input_norm.weight"] = hf_state[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_norm.weight"] = hf_state[p + "post_attention_layernorm.weight"]
    out["norm.weight"] = hf_state["model.norm.weight"]
    head = hf_state.get("lm_head.weight")
    out["lm_head.weight"] = head if head is not None and not spec.tie_word_embeddings else out["embed.weight"]
    return out
