"""A GGUF file's tensors under our network's names, memory-mapped and read one at a time.

The builder never loads a GGUF whole: builder/gguf_fields.py reads the header (gguf's GGUFReader
parsed every vocabulary entry: 7-17 s for a 128k-262k vocabulary), each tensor's bytes are mapped
only while it is read (packed or copied out), and each tensor is turned into what the engine stores only when its
module is built — raw block rows for the formats our kernels read (`GGUF_TYPE_NAMES`), fp32 for
the rest (F32/F16/BF16, and block types without a kernel, dequantized by `gguf.quants`). So the
build's memory is the engine's weights plus one module in flight, not the ~20x of a dequantizing
loader (a 1B Q4_K_M peaked at 24 GB through transformers' GGUF loader and was killed).

Names (the family's, builder/families/): a fused module (qkv, gate_up) is the row concatenation of
its GGUF tensors. llama.cpp writes Llama's attn_q/attn_k rows permuted for its rotary layout
(`Family.gguf_permuted_qk`); we undo it with the row permutation transformers' GGUF loader applies
(`_reverse_permute_weights`), and since a row of blocks is a row of weights, permuting block rows
is exact. Norm weights stored as (1 + w) (`Family.gguf_norm_offset`) are read as w.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ifb.builder.errors import SourceError
from ifb.builder.families import Family, gguf_family
from ifb.builder.families.family import GGUF_LAYER_LINEARS
from ifb.builder.gguf_fields import GgufHeader, read_gguf_header, without_vocabulary
from ifb.builder.gguf_metadata import field_value
from ifb.plugins.quant_formats import GGUF_TYPE_NAMES, WeightFormat
from ifb.runtime.engine_format import ModelSpec

logger = logging.getLogger(__name__)

_DENSE_TYPES = ("F32", "F16", "BF16", "F64")
# llama.cpp's activation block type Q8_K (no weight of a released file is stored so, but nothing
# stops a file): bytes per block, its scale's type and where its int8 values start; dequantized
# here, since gguf-py has no dequantizer for it
_Q8_ACTIVATION_TYPES = {"Q8_K": (292, np.float32, 4)}
# Types refused although something could read them, and why
_REFUSED_TYPES = {
    "Q8_1": "gguf-py sizes its blocks as 40 bytes where ggml writes 36, so its bytes cannot be trusted",
}
# Tensors llama.cpp's graph does not read either, and why: named in one build warning
_UNNEEDED_TENSORS = {
    ".attn_rot_embd.weight": "a rotary table of early conversions; RoPE is computed from rope.freq_base",
}


def linear_parts(spec: ModelSpec, family: Family, tensor_names: set[str]) -> dict[str, tuple[str, ...]]:
    """Our linear module name -> the GGUF tensor names whose rows it concatenates, in order."""
    parts: dict[str, tuple[str, ...]] = {}
    for i in range(spec.num_layers):
        for module, names in family.gguf_layer_linears.items():
            parts[f"layers.{i}.{module}"] = tuple(f"blk.{i}.{name}.weight" for name in names)
    untied = not spec.tie_word_embeddings and "output.weight" in tensor_names
    parts["lm_head"] = ("output.weight",) if untied else ("token_embd.weight",)
    return parts


def expert_parts(spec: ModelSpec, family: Family) -> dict[str, tuple[str, ...]]:
    """A mixture of experts' stacked weights -> the GGUF tensors ([experts, rows, cols] each) whose
    rows it concatenates per expert."""
    layer_experts = family.gguf_layer_experts if spec.is_moe else {}
    return {
        f"layers.{i}.{module}": tuple(f"blk.{i}.{name}.weight" for name in names)
        for i in range(spec.num_layers)
        for module, names in layer_experts.items()
    }


def biased_modules(spec: ModelSpec) -> tuple[str, ...]:
    """The layer's linear modules that carry a bias (q/k/v's is one fused bias, gate/up's too)."""
    biased = {
        "attn.qkv": spec.attention_bias,
        "attn.o_proj": spec.attention_out_bias,
        "mlp.gate_up": spec.mlp_bias,
        "mlp.down": spec.mlp_bias,
    }
    return tuple(module for module, has_bias in biased.items() if has_bias)


def dense_parts(spec: ModelSpec, family: Family) -> dict[str, tuple[str, ...]]:
    """Our non-linear tensor names (norms, biases, the embedding table) -> GGUF tensor names."""
    parts: dict[str, tuple[str, ...]] = {"embed.weight": ("token_embd.weight",), "norm.weight": ("output_norm.weight",)}
    layer_norms = family.gguf_layer_norms
    for i in range(spec.num_layers):
        for ours, theirs in layer_norms.items():
            parts[f"layers.{i}.{ours}.weight"] = (f"blk.{i}.{theirs}.weight",)
        if spec.qk_norm:
            for norm in ("q_norm", "k_norm"):
                parts[f"layers.{i}.attn.{norm}.weight"] = (f"blk.{i}.attn_{norm}.weight",)
        for module in biased_modules(spec):
            parts[f"layers.{i}.{module}.bias"] = tuple(f"blk.{i}.{name}.bias" for name in GGUF_LAYER_LINEARS[module])
        for ours, names in family.gguf_layer_dense.items():
            parts[f"layers.{i}.{ours}"] = tuple(f"blk.{i}.{name}" for name in names)
    return parts


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One GGUF tensor's header: what it is and what keeping it costs."""

    name: str
    type_name: str
    rows: int
    cols: int
    file_bytes: int

    @property
    def block_format(self) -> WeightFormat | None:
        """The block format our kernels read it in, None where it must be dequantized."""
        return GGUF_TYPE_NAMES.get(self.type_name)

    @property
    def is_dense(self) -> bool:
        return self.type_name in _DENSE_TYPES


class GgufTensors:
    """The tensors of one GGUF file (memory-mapped), read on demand under our conventions."""

    def __init__(self, path: Path, spec: ModelSpec) -> None:
        self._reader = read_gguf_header(path, without_vocabulary)
        self._tensors: dict[str, Any] = {t.name: t for t in self._reader.tensors}
        self.spec = spec
        # the file's family (a Mistral is written as a Llama): its names, permutation and offsets
        family = gguf_family(_architecture(self._reader), self._reader)
        self.permute = family.gguf_permuted_qk
        self.norm_shift = family.gguf_norm_offset
        self.linears = linear_parts(spec, family, set(self._tensors))
        self.dense = dense_parts(spec, family)
        self.experts = expert_parts(spec, family)
        needed = {
            name for names in (*self.linears.values(), *self.dense.values(), *self.experts.values()) for name in names
        }
        missing = sorted(needed - set(self._tensors))
        if missing:
            raise SourceError(f"{path} lacks tensors the {spec.architecture} network needs: {', '.join(missing[:8])}")
        _account_for_the_rest(
            path, _architecture(self._reader), set(self._tensors) - needed - set(family.gguf_config_tensors)
        )
        _refuse_unreadable_types(path, [self.info(name) for name in sorted(needed)])

    def info(self, name: str) -> TensorInfo:
        tensor = self._tensors[name]
        cols = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        rows = int(tensor.shape[1]) if len(tensor.shape) > 1 else 1
        return TensorInfo(name, tensor.tensor_type.name, rows, cols, int(tensor.n_bytes))

    def block_rows(self, name: str) -> torch.Tensor:
        """uint8 [rows, row bytes]: the tensor's blocks, q/k un-permuted (a copy), the rest aliasing a
        copy-on-write mapping of the file that lives as long as the tensor."""
        tensor = self._tensors[name]
        if GGUF_TYPE_NAMES.get(tensor.tensor_type.name) is None:
            raise ValueError(f"{name} is {tensor.tensor_type.name}, not a block format our kernels read")
        # packed straight from the mapping: a copy into fresh memory took ~0.5 s CPU of a 1B Q4_K_M's 4 s pack
        rows = torch.from_numpy(tensor.data)
        return self._unpermuted(name, rows)

    def fp32(self, name: str) -> torch.Tensor:
        """The tensor as fp32 in torch's [rows, cols] order (dequantized where stored as blocks)."""
        import gguf

        tensor = self._tensors[name]
        type_name = tensor.tensor_type.name
        if type_name in ("F32", "F16", "F64"):
            values = np.asarray(tensor.data)
        elif type_name in _Q8_ACTIVATION_TYPES:
            values = _dequantize_q8(np.asarray(tensor.data), type_name)
        else:
            values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        out = torch.from_numpy(np.array(values, dtype=np.float32, copy=True))  # F32 comes back as the mapping
        if self.norm_shift and name.endswith("norm.weight"):
            out = out - self.norm_shift
        return self._unpermuted(name, out)

    def expert_block_rows(self, module: str, expert: int) -> list[torch.Tensor]:
        """One expert's rows of blocks (uint8 [rows, row bytes]) of each stacked tensor of `module`."""
        parts = []
        for name in self.experts[module]:
            tensor = self._tensors[name]
            if GGUF_TYPE_NAMES.get(tensor.tensor_type.name) is None:
                raise ValueError(f"{name} is {tensor.tensor_type.name}, not a block format our kernels read")
            parts.append(torch.from_numpy(np.array(np.asarray(tensor.data)[expert], dtype=np.uint8, copy=True)))
        return parts

    def expert_fp32(self, module: str, expert: int) -> torch.Tensor:
        """One expert's weight [n, k] of `module`: its stacked tensors' slices, dequantized, rows concatenated."""
        import gguf

        parts = []
        for name in self.experts[module]:
            tensor = self._tensors[name]
            values = np.asarray(tensor.data)[expert]
            if tensor.tensor_type.name not in ("F32", "F16", "F64"):
                values = gguf.quants.dequantize(values, tensor.tensor_type)
            parts.append(torch.from_numpy(np.array(values, dtype=np.float32, copy=True)))
        return torch.cat(parts, dim=0)

    def fused_fp32(self, names: tuple[str, ...]) -> torch.Tensor:
        """The tensors' rows concatenated: a weight's along dim 0, a bias's along its last dim (its
        outputs; per expert where stacked [E, n], gpt-oss's ffn_gate_exps.bias + ffn_up_exps.bias)."""
        parts = [self.fp32(name) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1 if names[0].endswith(".bias") else 0)

    def _unpermuted(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        if not self.permute:
            return rows
        if ".attn_q." in name:
            return unpermute_rows(rows, self.spec.num_heads)
        if ".attn_k." in name:
            return unpermute_rows(rows, self.spec.num_kv_heads)
        return rows


def _account_for_the_rest(path: Path, architecture: str, rest: set[str]) -> None:
    """Every tensor the network does not take is named: in one warning where llama.cpp's graph
    does not read it either (and why), else refused (a weight we would silently drop)."""
    unneeded: dict[str, list[str]] = {}
    for name in sorted(rest):
        reason = next((why for suffix, why in _UNNEEDED_TENSORS.items() if name.endswith(suffix)), None)
        if reason is not None:
            unneeded.setdefault(reason, []).append(name)
    unknown = sorted(rest - {name for names in unneeded.values() for name in names})
    if unknown:
        shown = ", ".join(unknown[:8]) + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        raise SourceError(f"{path} has tensors the {architecture} network does not apply: {shown}")
    if unneeded:
        logger.warning(
            "GGUF tensor(s) not needed: %s",
            "; ".join(f"{', '.join(names)} ({why})" for why, names in unneeded.items()),
        )


def readable_type(type_name: str) -> bool:
    """Whether a GGUF tensor type can be read as floats here: kept as blocks, dense, or dequantized."""
    import gguf

    if type_name in _REFUSED_TYPES:
        return False
    if type_name in GGUF_TYPE_NAMES or type_name in _DENSE_TYPES or type_name in _Q8_ACTIVATION_TYPES:
        return True
    quant = getattr(gguf.quants, type_name, None)  # gguf-py's dequantizer class of that type, if any
    return isinstance(quant, type) and getattr(getattr(quant, "qtype", None), "name", None) == type_name


def _refuse_unreadable_types(path: Path, infos: list[TensorInfo]) -> None:
    """Refuse, by type and tensor, what no kernel reads and nothing here dequantizes (integer
    tensors, block types newer than gguf-py's dequantizers)."""
    unreadable: dict[str, list[str]] = {}
    for info in infos:
        if not readable_type(info.type_name):
            unreadable.setdefault(info.type_name, []).append(info.name)
    if unreadable:
        raise SourceError(
            f"{path} has tensors of GGUF types with no kernel and no dequantizer here: "
            + "; ".join(
                f"{kind}: {', '.join(names[:4])}" + (f" ({_REFUSED_TYPES[kind]})" if kind in _REFUSED_TYPES else "")
                for kind, names in unreadable.items()
            )
        )


def _dequantize_q8(data: np.ndarray, type_name: str) -> np.ndarray:
    """Q8_K (fp32 scale, 256 int8, 16 int16 sums): each weight is scale x int8; the sums are the
    activation kernels' and unused here."""
    block_bytes, scale_type, values_at = _Q8_ACTIVATION_TYPES[type_name]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, block_bytes)
    scale = blocks[:, : np.dtype(scale_type).itemsize].view(scale_type).astype(np.float32)
    values = blocks[:, values_at : values_at + 256].view(np.int8).astype(np.float32)
    return (scale * values).reshape(*data.shape[:-1], -1)


def unpermute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """transformers' `_reverse_permute_weights`, applied to whole rows (of weights or of blocks)."""
    half = rows.shape[0] // num_heads // 2
    order = torch.arange(rows.shape[0]).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)
    return rows[order]


def _architecture(header: GgufHeader) -> str:
    return str(field_value(header, "general.architecture"))
