"""MoeBlock: a mixture-of-experts MLP: the router's scores -> top-k -> one grouped op.

The router is a dense linear over the experts (with a bias where `router_bias`: gpt-oss). By
`router_scoring`: a softmax over every expert in fp32, the top `num_experts_per_tok` kept and,
where `norm_topk_prob`, renormalized to sum 1 (transformers' Qwen3MoeTopKRouter); or the top k
logits and a softmax over those k (GptOssTopKRouter). The weights are rounded to the model dtype,
as transformers does. The experts run as one op, `ifb_quant::grouped_experts` or, for experts with
biases or gpt-oss's clamped SwiGLU, `grouped_experts_variant` (plugins/grouped_experts.py): one op
in the exported graph whatever the routing, static shapes, each selected expert's weights read
once for all its rows and each row's result independent of the others. The stacked weights are
dense fp32 [E, n, k] or, once `store_blocks` says so, block tiles [E, *packed_shape] (every expert
packed as QuantLinear packs one weight); the biases [E, 2I] (gate then up) and [E, hidden].
"""

from __future__ import annotations

import torch
from torch import nn

from ifb.plugins.grouped_experts import ExpertActivation, ExpertVariant, grouped_experts_call
from ifb.plugins.quant_formats import WeightCompute, WeightFormat
from ifb.runtime.engine_format import ModelSpec, RouterScoring
from ifb.runtime.step.quant_linear import packed_shape

GATE_UP, DOWN = "experts_gate_up", "experts_down"


def expert_variant(spec: ModelSpec) -> ExpertVariant:
    """The grouped op's variant for the spec's experts: gpt-oss's clamped SwiGLU, or the plain one."""
    if spec.swiglu_limit is None:
        return ExpertVariant()
    return ExpertVariant(ExpertActivation.SWIGLU_CLAMPED, alpha=spec.swiglu_alpha, limit=spec.swiglu_limit)


def expert_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each stacked expert weight -> one expert's [n, k] (gate rows then up rows; down)."""
    return {
        GATE_UP: (2 * spec.moe_intermediate_size, spec.hidden_size),
        DOWN: (spec.hidden_size, spec.moe_intermediate_size),
    }


class MoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_experts, self.top_k = spec.num_experts, spec.num_experts_per_tok
        self.intermediate_size, self.norm_topk_prob = spec.moe_intermediate_size, spec.norm_topk_prob
        self.scoring, self.variant = spec.router_scoring, expert_variant(spec)
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=spec.router_bias)
        shapes = expert_shapes(spec)
        self.experts_gate_up = nn.Parameter(torch.zeros(spec.num_experts, *shapes[GATE_UP]), requires_grad=False)
        self.experts_down = nn.Parameter(torch.zeros(spec.num_experts, *shapes[DOWN]), requires_grad=False)
        self.experts_gate_up_bias: nn.Parameter | None = None
        self.experts_down_bias: nn.Parameter | None = None
        if spec.expert_bias:
            gate_up_rows, hidden = shapes[GATE_UP][0], spec.hidden_size
            self.experts_gate_up_bias = nn.Parameter(torch.zeros(spec.num_experts, gate_up_rows), requires_grad=False)
            self.experts_down_bias = nn.Parameter(torch.zeros(spec.num_experts, hidden), requires_grad=False)
        self.formats = (WeightFormat.FP32, WeightFormat.FP32)
        self.compute = WeightCompute.FP32

    def store_as(self, name: str, fmt: WeightFormat, compute: WeightCompute) -> None:
        """Hold the stacked weight `name` as `fmt` (a block format: its tiles packed for `compute`,
        uint8, a parameter as QuantLinear's so AOTInductor does not clone it; fp32: dense)."""
        if fmt.is_block:
            n, k = tuple(getattr(self, name).shape[1:])
            tiles = torch.zeros(self.num_experts, *packed_shape(fmt, n, k), dtype=torch.uint8)
            setattr(self, name, nn.Parameter(tiles, requires_grad=False))
        index = (GATE_UP, DOWN).index(name)
        self.formats = (fmt, self.formats[1]) if index == 0 else (self.formats[0], fmt)
        self.compute = compute

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k expert ids and their weights in x's dtype (transformers rounds them so)."""
        logits = self.router(x)
        if self.scoring is RouterScoring.TOP_K_SOFTMAX:
            top_logits, top_ids = torch.topk(logits, self.top_k, dim=-1)
            return top_ids, torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_ids, top_weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_ids, top_weights = self.route(x)
        # The op takes x and the weights in the model dtype and returns its dtype, widening and
        # rounding inside (a compiled graph drops a bf16 -> fp32 round trip's rounding); a 16-bit
        # engine's dense experts are widened weight by weight there too, never copied whole
        return grouped_experts_call(
            x,
            top_ids,
            top_weights,
            self.experts_gate_up,
            self.experts_down,
            self.formats,
            self.compute,
            self.intermediate_size,
            self.variant,
            self.experts_gate_up_bias,
            self.experts_down_bias,
        )

    def extra_repr(self) -> str:
        formats = "/".join(fmt.value for fmt in self.formats)
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, {self.scoring.value}, {formats}, "
            f"compute={self.compute.value}, {self.variant.fields}, biases={self.experts_gate_up_bias is not None}"
        )
