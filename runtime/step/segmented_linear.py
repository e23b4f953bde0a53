"""SegmentedLinear: a fused linear (qkv, gate_up) whose parts are stored in different formats.

llama.cpp's Q4_K_M quantizer stores `attn_v` (and some `ffn_down`) as Q6_K beside Q4_K
`attn_q`/`attn_k`, so a fused module's GGUF parts can differ. Converting the whole module to one
format would either lose the file's numerics or cost fp32 bytes; instead each run of adjacent
parts with one format is its own segment (a QuantLinear, or an nn.Linear for parts we store
dense) and the outputs are concatenated in part order, so the module computes exactly what the
unfused parts would.

engine.json records such a module per part: `"layers.0.attn.qkv[2]": "q6_k"` (`part_key`); a
module stored in one format keeps its plain name.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import groupby

import torch
from torch import nn

from ifb.plugins.quant_formats import WeightCompute, WeightFormat
from ifb.runtime.step.quant_linear import QuantLinear


def part_key(module: str, part: int) -> str:
    """The weight_formats key of one GGUF part of a mixed-format fused module."""
    return f"{module}[{part}]"


def part_formats(weight_formats: Mapping[str, WeightFormat], module: str, num_parts: int) -> list[WeightFormat] | None:
    """The per-part formats of `module` when it is recorded part by part, else None."""
    keys = [part_key(module, i) for i in range(num_parts)]
    if not any(key in weight_formats for key in keys):
        return None
    return [weight_formats.get(key, WeightFormat.FP32) for key in keys]


def segment_parts(formats: list[WeightFormat]) -> list[list[int]]:
    """The part indices of each segment: each run of adjacent parts with one format, in order."""
    return [list(group) for _, group in groupby(range(len(formats)), key=formats.__getitem__)]


def segments(formats: list[WeightFormat], part_rows: tuple[int, ...]) -> list[tuple[WeightFormat, int]]:
    """Each segment's format and rows: [(format, rows)] in part order."""
    return [(formats[parts[0]], sum(part_rows[i] for i in parts)) for parts in segment_parts(formats)]


class SegmentedLinear(nn.Module):
    """y = cat(segment_0(x), segment_1(x), ...) (+ bias); segment i is child module `str(i)`."""

    def __init__(
        self, in_features: int, layout: list[tuple[WeightFormat, int]], bias: bool, compute: WeightCompute
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in layout)
        self.parts = nn.ModuleList(
            nn.Linear(in_features, rows, bias=False)
            if fmt is WeightFormat.FP32
            else QuantLinear(fmt, in_features, rows, compute=compute)
            for fmt, rows in layout
        )
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias
