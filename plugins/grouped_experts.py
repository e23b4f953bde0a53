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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ifb.plugins import quant_ops
from ifb.plugins.quant_formats import WeightCompute, WeightFormat

DENSE_FORMAT = WeightFormat.FP32.value

quant_ops._LIBRARY.define(
    "grouped_experts(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate_up, Tensor down, "
    "str gate_up_format, str down_format, str compute, int intermediate) -> Tensor"
)

GROUPED_EXPERTS_SHIM = (
    "AOTITorchError aoti_torch_cpu_grouped_experts(AtenTensorHandle x, AtenTensorHandle expert_ids, "
    "AtenTensorHandle expert_weights, AtenTensorHandle gate_up, AtenTensorHandle down, const char* gate_up_format, "
    "const char* down_format, const char* compute, int64_t intermediate, AtenTensorHandle* ret0)"
)


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


def reference_grouped_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    intermediate: int,
) -> torch.Tensor:
    """Row by row, expert by expert, in float64 from dense weights [E, 2I, H] and [E, H, I]: what the
    op computes (a test's definition of it, not a path of the engine)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for row in range(x.shape[0]):
        for slot in range(expert_ids.shape[1]):
            e = int(expert_ids[row, slot])
            h = x[row].double() @ gate_up[e].double().T
            act = F.silu(h[:intermediate]) * h[intermediate:]
            out[row] += float(expert_weights[row, slot]) * (act @ down[e].double().T)
    return out
