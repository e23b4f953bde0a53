"""Raw Q4_0/Q4_1/Q8_0 blocks of a llama-family GGUF file, mapped onto our fused linear modules.

A fused module (qkv, gate_up) is the row concatenation of its GGUF tensors, as convert.py fuses
the fp32 weights. llama.cpp writes Llama's attn_q/attn_k rows permuted; transformers' GGUF loader
undoes that with a row permutation (`LlamaTensorProcessor._reverse_permute_weights`), and since a
row of blocks is a row of weights the same permutation of block rows is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ifb.plugins.quant_formats import WeightFormat
from ifb.runtime.engine_format import ModelSpec

BLOCK_TYPES = {"Q4_0": WeightFormat.Q4_0, "Q4_1": WeightFormat.Q4_1, "Q8_0": WeightFormat.Q8_0}
PERMUTED_ARCHITECTURES = ("llama",)  # those transformers reads with LlamaTensorProcessor
_LAYER_PARTS = {
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.o_proj": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}


@dataclass(frozen=True, slots=True)
class GgufModuleBlocks:
    """What a GGUF file holds for our linear modules: block rows, and what cannot be kept."""

    blocks: dict[str, tuple[WeightFormat, torch.Tensor]]  # module -> (format, uint8 [n, k/32 * block bytes])
    skipped: list[str]  # human-readable: "blk.0.attn_v.weight (Q6_K)", "layers.0.attn.qkv (Q4_0 + Q6_K)"


def module_parts(spec: ModelSpec, tensor_names: set[str]) -> dict[str, tuple[str, ...]]:
    """Our linear module name -> the GGUF tensor names whose rows it concatenates."""
    parts: dict[str, tuple[str, ...]] = {}
    for i in range(spec.num_layers):
        for module, names in _LAYER_PARTS.items():
            parts[f"layers.{i}.{module}"] = tuple(f"blk.{i}.{name}.weight" for name in names)
    untied = not spec.tie_word_embeddings and "output.weight" in tensor_names
    parts["lm_head"] = ("output.weight",) if untied else ("token_embd.weight",)
    return parts


def _architecture(reader: object) -> str:
    field = reader.fields["general.architecture"]  # type: ignore[attr-defined]
    return bytes(field.parts[field.data[0]]).decode()


def _unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """transformers' `_reverse_permute_weights`, applied to whole rows (of weights or of blocks)."""
    half = rows.shape[0] // num_heads // 2
    order = torch.arange(rows.shape[0]).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)
    return rows[order]


def _part_blocks(tensor: object, spec: ModelSpec, permute: bool) -> torch.Tensor:
    name: str = tensor.name  # type: ignore[attr-defined]
    rows = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))  # type: ignore[attr-defined]
    if permute and ".attn_q." in name:
        return _unpermute_rows(rows, spec.num_heads)
    if permute and ".attn_k." in name:
        return _unpermute_rows(rows, spec.num_kv_heads)
    return rows


def read_module_blocks(path: Path, spec: ModelSpec) -> GgufModuleBlocks:
    """Every linear module whose GGUF parts all share one block format, as fused block rows."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    permute = _architecture(reader) in PERMUTED_ARCHITECTURES
    blocks: dict[str, tuple[WeightFormat, torch.Tensor]] = {}
    skipped: list[str] = []
    for module, names in module_parts(spec, set(tensors)).items():
        types = [tensors[name].tensor_type.name for name in names]
        other = [f"{name} ({kind})" for name, kind in zip(names, types, strict=True) if kind not in BLOCK_TYPES]
        if other:
            skipped += other
        elif len(set(types)) > 1:
            skipped.append(f"{module} (parts differ: {' + '.join(types)})")
        else:
            fused = torch.cat([_part_blocks(tensors[name], spec, permute) for name in names], dim=0)
            blocks[module] = (BLOCK_TYPES[types[0]], fused)
    return GgufModuleBlocks(blocks, skipped)


def has_block_linears(path: Path) -> bool:
    """True when some linear tensor of the GGUF file is Q4_0/Q4_1/Q8_0 (reads only the header)."""
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    layer_parts = {name for names in _LAYER_PARTS.values() for name in names}
    head = "output.weight" if "output.weight" in types else "token_embd.weight"
    linear = [kind for name, kind in types.items() if name == head or name.split(".")[-2] in layer_parts]
    return any(kind in BLOCK_TYPES for kind in linear)
