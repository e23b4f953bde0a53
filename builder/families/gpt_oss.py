"""gpt-oss (gpt-oss-20b, -120b): a mixture of experts in every layer, with transformers' GptOss
classes' differences from Mixtral's layer, each a ModelSpec field the network reads:

- attention: q/k/v and o biases; a learned sink logit per query head in each softmax's
  denominator (`attention_sinks`, the layer's `attn.sinks`); sliding (window `sliding_window`,
  128 in the releases) and full layers alternating as `layer_types` says (even layers slide);
  YaRN RoPE with `truncate: false` (the correction range not rounded);
- router: a linear with a bias; the top k logits, then a softmax over those k (`router_scoring`);
- experts: biases on gate/up and down; the clamped SwiGLU (swiglu_alpha 1.702, swiglu_limit 7.0 in
  the config): gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate *
  sigmoid(alpha * gate).

HF checkpoints stack the experts: `mlp.experts.gate_up_proj` [E, hidden, 2I] with gate and up
interleaved (even columns gate, odd up), its bias [E, 2I] likewise, `down_proj` [E, I, hidden];
each expert is read transposed, gate rows first, as the grouped op takes it. The released
checkpoints (`quantization_config` mxfp4) hold them as MXFP4 instead: `*_blocks` [E, rows, K/32,
16] (rows gate/up interleaved as above, K the input) and e8m0 `*_scales` [E, rows, K/32]; each
32-value block is repacked into ggml's MXFP4 block (its scale byte, then nibbles element j low and
j + 16 high where the checkpoint has 2j low and 2j + 1 high, as llama.cpp's converter repacks
them), rows gate first, and kept as blocks.

llama.cpp's converter writes arch `gpt-oss`: `attn_sinks.weight`, `ffn_gate_inp` with its bias,
the experts stacked and split (`ffn_{gate,up}_exps` with biases, `ffn_down_exps`), the MLP's norm
as `post_attention_norm`, `expert_feed_forward_length`, the window as `attention.sliding_window`.
It writes neither the SwiGLU constants (llama.cpp's graph fixes them at 1.702 and 7.0, the
releases' values) nor YaRN's `truncate` (every released config says false; transformers' default,
absent, is true): a file is read with those values.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import HF_LAYER_NORMS, checked_window, gguf_window, sliding_layers
from ifb.builder.families.routed_experts import ATTENTION_LINEARS_GGUF, EXPERT_COUNT_KEYS, RoutedExperts
from ifb.builder.gguf_metadata import field_value, rope_scaling_parameters
from ifb.plugins.quant_formats import WeightFormat
from ifb.runtime.engine_format import ModelSpec, RouterScoring

# llama.cpp's gpt-oss graph: its clamped SwiGLU's constants (no GGUF key holds them)
LLAMA_CPP_SWIGLU_ALPHA, LLAMA_CPP_SWIGLU_LIMIT = 1.702, 7.0
_GATE_UP, _GATE_UP_BIAS, _DOWN = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj"


def _gate_rows_first(rows: torch.Tensor) -> torch.Tensor:
    """Interleaved gate/up along the last dim (gate even, up odd) -> gate's then up's."""
    return torch.cat((rows[..., 0::2], rows[..., 1::2]), dim=-1)


class GptOss(RoutedExperts):
    model_type = "gpt_oss"
    gguf_architecture = "gpt-oss"
    releases = "gpt-oss-20b, gpt-oss-120b (mixtures of experts)"
    config_attention_bias = True
    num_experts_field = "num_local_experts"
    expert_width_field = "intermediate_size"  # GptOssConfig's intermediate_size is one expert's
    gguf_keys = (*EXPERT_COUNT_KEYS, "expert_feed_forward_length")
    gguf_layer_linears = ATTENTION_LINEARS_GGUF
    hf_layer_norms = {**HF_LAYER_NORMS, "mlp.router": "mlp.router"}
    gguf_layer_norms = {"input_norm": "attn_norm", "post_norm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}
    hf_experts_stacked = True
    hf_expert_blocks = ("_blocks", "_scales", WeightFormat.MXFP4)
    hf_layer_experts = {"mlp.experts_gate_up": (_GATE_UP,), "mlp.experts_down": (_DOWN,)}
    gguf_layer_experts = {
        "mlp.experts_gate_up": ("ffn_gate_exps", "ffn_up_exps"),
        "mlp.experts_down": ("ffn_down_exps",),
    }
    hf_layer_dense = {
        "attn.sinks": ("self_attn.sinks",),
        "mlp.router.bias": ("mlp.router.bias",),
        "mlp.experts_gate_up_bias": (_GATE_UP_BIAS,),
        "mlp.experts_down_bias": ("mlp.experts.down_proj_bias",),
    }
    gguf_layer_dense = {
        "attn.sinks": ("attn_sinks.weight",),
        "mlp.router.bias": ("ffn_gate_inp.bias",),
        "mlp.experts_gate_up_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
        "mlp.experts_down_bias": ("ffn_down_exps.bias",),
    }

    def model_spec(self, config: Any) -> ModelSpec:
        quantization = getattr(config, "quantization_config", None) or {}
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        if method not in (None, "mxfp4"):
            raise UnsupportedModelError(
                f"gpt_oss with quantization_config quant_method={method!r} is not supported; only the released "
                "checkpoints' 'mxfp4' experts (or none)"
            )
        spec = super().model_spec(config)
        sliding = sliding_layers(config)
        window = checked_window(config, getattr(config, "sliding_window", None)) if sliding else None
        full = tuple(i for i in range(spec.num_layers) if i not in sliding)
        return replace(
            spec,
            attention_sinks=True,
            sliding_window=window,
            full_attention_layers=full if window is not None else (),
            router_scoring=RouterScoring.TOP_K_SOFTMAX,
            router_bias=True,
            expert_bias=True,
            swiglu_alpha=float(config.swiglu_alpha),
            swiglu_limit=float(config.swiglu_limit),
        )

    def norm_topk_prob(self, config: Any) -> bool:
        return False  # the softmax over the k chosen logits already sums to 1

    def hf_stacked_expert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """gate_up [hidden, 2I] -> [2I, hidden], gate rows first; down [I, hidden] -> [hidden, I]."""
        if name.endswith(_GATE_UP):
            return _gate_rows_first(tensor).T.contiguous()
        return tensor.T.contiguous()

    def hf_stacked_expert_blocks(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """One expert's MXFP4 blocks [rows, K/32, 16] and scales [rows, K/32] as ggml's MXFP4 rows
        [rows, K/32 * 17] (module docstring), gate rows first."""
        codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        rows = torch.cat((scales.to(torch.uint8)[..., None], nibbles), dim=-1).reshape(blocks.shape[0], -1)
        return torch.cat((rows[0::2], rows[1::2])) if _GATE_UP in name else rows

    def read_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return _gate_rows_first(tensor) if name.endswith(_GATE_UP_BIAS) else tensor

    def read_gguf(self, config: Any, reader: Any) -> Any:
        """The experts' width, the window, and what the converter does not write (module docstring)."""
        config = super().read_gguf(config, reader)
        width = field_value(reader, f"{self.gguf_name}.expert_feed_forward_length")
        if width is not None:
            config.intermediate_size = int(width)
        config.swiglu_alpha, config.swiglu_limit = LLAMA_CPP_SWIGLU_ALPHA, LLAMA_CPP_SWIGLU_LIMIT
        return config

    def read_rope_scaling(self, config: Any, reader: Any) -> None:
        """The file's scaling only: GptOssConfig's default YaRN is not the file's where it has none."""
        scaling = rope_scaling_parameters(reader, self.gguf_name) or {"rope_type": "default"}
        if scaling["rope_type"] == "yarn":
            scaling["truncate"] = False
        config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **scaling}

    def read_window(self, config: Any, reader: Any) -> Any:
        """`attention.sliding_window` (transformers' GGUF reader leaves GptOssConfig's 128); the
        layers it applies to are GptOssConfig's default `layer_types`, llama.cpp's pattern too."""
        config.sliding_window = gguf_window(reader, self.gguf_name) or None
        return config
