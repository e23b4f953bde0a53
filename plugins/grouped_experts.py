"""The mixture-of-experts op `ifb_quant::grouped_experts`: schema, fake kernel, C shim, reference.

`grouped_experts(x, expert_ids, expert_weights, gate_up, down, gate_up_format, down_format,
compute, intermediate)` is a whole MoE layer after its router: x [rows, hidden] (float32, or a 16-bit
engine's bfloat16/float16), the router's top-k `expert_ids` [rows, k] int64 and `expert_weights`
[rows, k] in x's dtype, the stacked experts' gate/up rows `gate_up` (expert e: [2 * intermediate,
hidden], gate rows first) and `down` (e: [hidden, intermediate]); returns [rows, hidden] in x's
dtype. A 16-bit x and weights are widened exactly inside, the sums are float32 and the result is
rounded once at the end: the casts are the op's, so a compiled graph cannot fuse them away (it
did: a bf16 engine's compiled step fed the experts its unrounded fp32 norm output). Shapes are
static in the exported graph: however the rows route, the op takes and returns the same shapes.

Each stacked weight is dense (`format` "fp32": float32 [E, n, k], or bfloat16/float16 in a 16-bit
engine, widened weight by weight) or block tiles (a block
WeightFormat's value: uint8 [E, *quant_linear.packed_shape(fmt, n, k)], each expert packed by
`quant_ops.pack` for compute fp32 or `pack_int8` for compute int8). The kernel
(csrc/grouped_experts.cpp) groups the rows by expert, reads each selected expert's weights once for
all its rows with the per-format matmul of `quant_matmul`, and adds each row's experts in
ascending id, so every row's result is bitwise independent of the other rows.

`grouped_experts_variant(..., intermediate, variant, gate_up_bias, down_bias)` is the same op
with its variant as named fields (`ExpertVariant.fields`: `act=swiglu_clamped;alpha=1.702;limit=7`,
parsed by the kernel, csrc/expert_variant.h, unknown names refused) and optional per-expert
biases [E, 2 * intermediate] (gate rows then up rows) and [E, hidden], added to each matmul's
output: gpt-oss. A later variant is a new field, not a new op. `grouped_experts` stays: engines
built before the variant call its shim by name from their compiled step, and new builds still
call it for the plain SwiGLU experts without biases (`grouped_experts_call` picks), so an engine
whose library predates the variant op keeps running eagerly too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F

from ifb.plugins import quant_ops
from ifb.plugins.quant_formats import WeightCompute, WeightFormat

DENSE_FORMAT = WeightFormat.FP32.value

quant_ops._LIBRARY.define(
    "grouped_experts(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate_up, Tensor down, "
    "str gate_up_format, str down_format, str compute, int intermediate) -> Tensor"
)

quant_ops._LIBRARY.define(
    "grouped_experts_variant(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate_up, Tensor down, "
    "str gate_up_format, str down_format, str compute, int intermediate, str variant, Tensor? gate_up_bias, "
    "Tensor? down_bias) -> Tensor"
)

GROUPED_EXPERTS_SHIM = (
    "AOTITorchError aoti_torch_cpu_grouped_experts(AtenTensorHandle x, AtenTensorHandle expert_ids, "
    "AtenTensorHandle expert_weights, AtenTensorHandle gate_up, AtenTensorHandle down, const char* gate_up_format, "
    "const char* down_format, const char* compute, int64_t intermediate, AtenTensorHandle* ret0)"
)
# An optional tensor reaches a C shim as a pointer to its handle, nullptr for None (AOTInductor's
# cpp wrapper, `val_to_arg_str`)
GROUPED_EXPERTS_VARIANT_SHIM = (
    "AOTITorchError aoti_torch_cpu_grouped_experts_variant(AtenTensorHandle x, AtenTensorHandle expert_ids, "
    "AtenTensorHandle expert_weights, AtenTensorHandle gate_up, AtenTensorHandle down, const char* gate_up_format, "
    "const char* down_format, const char* compute, int64_t intermediate, const char* variant, "
    "AtenTensorHandle* gate_up_bias, AtenTensorHandle* down_bias, AtenTensorHandle* ret0)"
)


class ExpertActivation(str, Enum):
    """The activation between an expert's gate/up and its down projection (the variant's `act`)."""

    SWIGLU = "swiglu"  # silu(gate) * up: Qwen3-MoE, OLMoE, Mixtral
    # gpt-oss: gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate)
    SWIGLU_CLAMPED = "swiglu_clamped"


@dataclass(frozen=True, slots=True)
class ExpertVariant:
    """What the variant op computes beyond the plain one: the activation and its constants."""

    activation: ExpertActivation = ExpertActivation.SWIGLU
    alpha: float | None = None  # SWIGLU_CLAMPED's sigmoid gain (gpt-oss: 1.702)
    limit: float | None = None  # SWIGLU_CLAMPED's clamp (gpt-oss: 7.0)

    def __post_init__(self) -> None:
        clamped = self.activation is ExpertActivation.SWIGLU_CLAMPED
        if (self.alpha is not None, self.limit is not None) != (clamped, clamped):
            raise ValueError(
                f"alpha and limit go with {ExpertActivation.SWIGLU_CLAMPED.value} and only with it: {self}"
            )

    @property
    def fields(self) -> str:
        """The op's `variant` argument (repr: a float's exact digits)."""
        parts = [f"act={self.activation.value}"]
        if self.activation is ExpertActivation.SWIGLU_CLAMPED:
            parts += [f"alpha={self.alpha!r}", f"limit={self.limit!r}"]
        return ";".join(parts)


def grouped_experts_shims() -> dict[object, list[str]]:
    """The MoE ops -> their C shims, for AOTInductor (quant_ops.aoti_configs)."""
    return {
        torch.ops.ifb_quant.grouped_experts.default: [GROUPED_EXPERTS_SHIM],
        torch.ops.ifb_quant.grouped_experts_variant.default: [GROUPED_EXPERTS_VARIANT_SHIM],
    }


@torch.library.register_fake("ifb_quant::grouped_experts")
def _grouped_experts_fake(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_format: str,
    down_format: str,
    compute: str,
    intermediate: int,
) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("ifb_quant::grouped_experts_variant")
def _grouped_experts_variant_fake(x: torch.Tensor, *routing_weights_and_variant: object) -> torch.Tensor:
    return torch.empty_like(x)


def expert_format(fmt: WeightFormat) -> str:
    """The op's format argument for a stacked expert weight stored as `fmt`."""
    return fmt.value if fmt.is_block else DENSE_FORMAT


def grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    formats: tuple[WeightFormat, WeightFormat],
    compute: WeightCompute,
    intermediate: int,
) -> torch.Tensor:
    """The op (the kernel library must be loaded): see the module docstring."""
    return torch.ops.ifb_quant.grouped_experts(
        x,
        expert_ids,
        expert_weights,
        gate_up,
        down,
        expert_format(formats[0]),
        expert_format(formats[1]),
        WeightCompute(compute).value,
        intermediate,
    )


def grouped_experts_call(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    formats: tuple[WeightFormat, WeightFormat],
    compute: WeightCompute,
    intermediate: int,
    variant: ExpertVariant,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain op where it computes this (SwiGLU, no bias), else the variant op."""
    if variant == ExpertVariant() and gate_up_bias is None and down_bias is None:
        return grouped_experts(x, expert_ids, expert_weights, gate_up, down, formats, compute, intermediate)
    return torch.ops.ifb_quant.grouped_experts_variant(
        x,
        expert_ids,
        expert_weights,
        gate_up,
        down,
        expert_format(formats[0]),
        expert_format(formats[1]),
        WeightCompute(compute).value,
        intermediate,
        variant.fields,
        gate_up_bias,
        down_bias,
    )


def reference_activation(h: torch.Tensor, intermediate: int, variant: ExpertVariant) -> torch.Tensor:
    """An expert's activation of its gate/up output h [..., 2 * intermediate] (gate first), in h's dtype."""
    gate, up = h[..., :intermediate], h[..., intermediate:]
    if variant.activation is ExpertActivation.SWIGLU:
        return F.silu(gate) * up
    assert variant.alpha is not None and variant.limit is not None
    gate, up = gate.clamp(max=variant.limit), up.clamp(-variant.limit, variant.limit)
    return (up + 1) * gate * torch.sigmoid(gate * variant.alpha)


def reference_grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    intermediate: int,
    variant: ExpertVariant = ExpertVariant(),
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row by row, expert by expert, in float64 from dense weights [E, 2I, H] and [E, H, I] (and
    biases [E, 2I], [E, H]): what the op computes (a test's definition of it, not a path of the engine)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for row in range(x.shape[0]):
        for slot in range(expert_ids.shape[1]):
            e = int(expert_ids[row, slot])
            h = x[row].double() @ gate_up[e].double().T
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            y = reference_activation(h, intermediate, variant) @ down[e].double().T
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[row] += float(expert_weights[row, slot]) * y
    return out
