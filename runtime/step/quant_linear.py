"""QuantLinear: a linear layer whose weight is stored as packed GGUF blocks (any block `WeightFormat`).

The packed tiles are a persistent uint8 buffer, so they are saved and loaded with the other
weights and AOTInductor's freezing keeps them as uint8 constants fed to the op. With the default
compute mode activations stay fp32: the kernel dequantizes each block in registers and
accumulates one serial fp32 FMA chain per output. With `--compute int8` each row is quantized
per 32-block and multiplied with integer dots (every format, K-quants included). Either way each
output is computed from its own row only, which is what makes a row's result independent of the
rest of the batch.
"""

from __future__ import annotations

import torch
from torch import nn

from ifb.plugins import quant_ops
from ifb.plugins.quant_formats import WeightCompute, WeightFormat, block_bytes, block_weights

# The one place a compute mode picks its op and its packing (same packed shape for both).
_MATMUL_OPS = {
    WeightCompute.FP32: torch.ops.ifb_quant.quant_matmul,
    WeightCompute.INT8: torch.ops.ifb_quant.quant_matmul_int8,
}
PACKERS = {WeightCompute.FP32: quant_ops.pack, WeightCompute.INT8: quant_ops.pack_int8}


def packed_shape(fmt: WeightFormat, n: int, k: int) -> tuple[int, int]:
    """Shape of `quant_ops.pack`'s (and `pack_int8`'s) output for an [n, k] weight."""
    return quant_ops.num_tiles(n), k // block_weights(fmt) * quant_ops.TILE_COLUMNS * block_bytes(fmt)


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W [out_features, in_features] held as `quant_ops.pack` tiles."""

    def __init__(
        self,
        fmt: WeightFormat,
        in_features: int,
        out_features: int,
        bias: bool = False,
        compute: WeightCompute = WeightCompute.FP32,
    ) -> None:
        super().__init__()
        if not fmt.is_block or in_features % block_weights(fmt):
            weights = block_weights(fmt) if fmt.is_block else "its block"
            raise ValueError(
                f"QuantLinear needs a block format and K % {weights} == 0, got {fmt.value}, K={in_features}"
            )
        self.fmt, self.in_features, self.out_features, self.compute = fmt, in_features, out_features, compute
        self._matmul = _MATMUL_OPS[compute]
        # A parameter, not a buffer: AOTInductor clones every buffer of the module it compiles as
        # the buffer's initial value (compile_fx's _unlift_graph), a copy of every packed weight in
        # the compiling process (9 GiB for an 8B build), and clones no parameter.
        self.packed = nn.Parameter(
            torch.zeros(packed_shape(fmt, out_features, in_features), dtype=torch.uint8), requires_grad=False
        )
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.packed, self.fmt.value, self.out_features, self.in_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.fmt.value}, compute={self.compute.value}, in_features={self.in_features}, out_features={self.out_features}"
