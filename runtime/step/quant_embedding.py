"""QuantEmbedding: the token embedding read as rows of a block-format table.

A GGUF's `token_embd` is block-quantized (Q6_K in a Q4_K_M file, Q8_0 in the bundled SmolLM2);
an fp32 copy of it would be vocab x hidden x 4 bytes (1 GB for a 1B Llama's 128k vocabulary,
and read by nothing but a gather). The op dequantizes only the gathered rows, bit-equal to
`quant_formats.dequantize`. With tied embeddings the table *is* the LM head's packed tiles, so
the blocks are stored once: the module then holds no buffer of its own and reads the head's.
"""

from __future__ import annotations

import torch
from torch import nn

from ifb.plugins import quant_ops
from ifb.plugins.quant_formats import WeightCompute, WeightFormat
from ifb.runtime.step.quant_linear import QuantLinear, packed_shape


class QuantEmbedding(nn.Module):
    """ids [T] -> fp32 [T, dim], from its own packed table or the tied head's (`shared_head`)."""

    def __init__(
        self, fmt: WeightFormat, num_embeddings: int, dim: int, shared_head: QuantLinear | None = None
    ) -> None:
        super().__init__()
        self.fmt, self.num_embeddings, self.dim = fmt, num_embeddings, dim
        # A list, not an attribute: the head is registered once, under lm_head, so its tiles are
        # saved once and export lifts them as one constant.
        self._shared: list[QuantLinear] = [shared_head] if shared_head is not None else []
        self.compute = shared_head.compute if shared_head is not None else WeightCompute.FP32
        if shared_head is None:
            # a parameter, as QuantLinear.packed, so AOTInductor does not copy it
            self.packed = nn.Parameter(
                torch.zeros(packed_shape(fmt, num_embeddings, dim), dtype=torch.uint8), requires_grad=False
            )

    def table(self) -> torch.Tensor:
        return self._shared[0].packed if self._shared else self.packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quant_ops.quant_embedding(ids, self.table(), self.fmt, self.compute, self.num_embeddings, self.dim)

    def extra_repr(self) -> str:
        shared = ", shared with lm_head" if self._shared else ""
        return f"{self.fmt.value}, {self.num_embeddings}x{self.dim}{shared}"
