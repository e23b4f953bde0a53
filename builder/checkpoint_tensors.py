"""A Hugging Face checkpoint folder's tensors under our network's names, read one at a time.

`safe_open` maps each *.safetensors file; a tensor is read (and converted to fp32) only when its
module is built, so a bf16 checkpoint is never held whole in fp32 (`load_file` + `.float()` on
every tensor needed 2x the checkpoint in fp32 before the first module was converted).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ifb.builder.errors import SourceError
from ifb.builder.families import FAMILIES, family_of
from ifb.builder.families.family import HF_LAYER_LINEARS
from ifb.builder.gguf_tensors import TensorInfo, biased_modules
from ifb.plugins.quant_formats import block_weights, dequantize
from ifb.runtime.engine_format import ModelSpec

_TYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def has_block_experts(folder: Path, model_type: str) -> bool:
    """Whether the checkpoint holds its family's stacked experts as blocks (gpt-oss's MXFP4), by
    the tensor names in the safetensors headers alone."""
    from safetensors import safe_open

    family = FAMILIES.get(model_type)  # an unknown one is refused by name where the config is read
    suffixes = family.hf_expert_blocks if family is not None else None
    if suffixes is None:
        return False
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if any(key.endswith(suffixes[0]) for key in handle.keys()):
                return True
    return False


class CheckpointTensors:
    """The tensors of an HF checkpoint folder under its family's names, read on demand (all dense)."""

    def __init__(self, folder: Path, spec: ModelSpec) -> None:
        from safetensors import SafetensorError, safe_open

        self.spec = spec
        self.family = family_of(spec.architecture)
        self._files: dict[str, object] = {}
        self._block_scales: dict[str, str] = {}  # a stacked experts' blocks tensor -> its scales tensor
        self._where: dict[str, str] = {}
        for file in sorted(folder.glob("*.safetensors")):
            try:
                handle = safe_open(str(file), framework="pt")
            except SafetensorError as error:
                raise SourceError(f"cannot read weights {file}: {error}") from error
            self._files[file.name] = handle
            self._where.update(dict.fromkeys(handle.keys(), file.name))  # type: ignore[attr-defined]
        self.linears = self._linear_parts()
        self.dense = self._dense_parts()
        self._expert_names = self._expert_parts()
        self.experts = {
            module: tuple(dict.fromkeys(sum(per_expert, ()))) for module, per_expert in self._expert_names.items()
        }
        every = (
            *self.linears.values(),
            *self.dense.values(),
            *self.experts.values(),
            tuple(self._block_scales.values()),
        )
        missing = sorted({n for names in every for n in names} - set(self._where))
        if missing:
            raise SourceError(f"{folder} lacks tensors the {spec.architecture} network needs: {', '.join(missing[:8])}")

    def _linear_parts(self) -> dict[str, tuple[str, ...]]:
        parts: dict[str, tuple[str, ...]] = {}
        layer_linears = family_of(self.spec.architecture).hf_layer_linears
        for i in range(self.spec.num_layers):
            for module, names in layer_linears.items():
                parts[f"layers.{i}.{module}"] = tuple(f"model.layers.{i}.{name}.weight" for name in names)
        untied = not self.spec.tie_word_embeddings and "lm_head.weight" in self._where
        parts["lm_head"] = ("lm_head.weight",) if untied else ("model.embed_tokens.weight",)
        return parts

    def _dense_parts(self) -> dict[str, tuple[str, ...]]:
        parts: dict[str, tuple[str, ...]] = {
            "embed.weight": ("model.embed_tokens.weight",),
            "norm.weight": ("model.norm.weight",),
        }
        layer_norms = family_of(self.spec.architecture).hf_layer_norms
        for i in range(self.spec.num_layers):
            for ours, theirs in layer_norms.items():
                parts[f"layers.{i}.{ours}.weight"] = (f"model.layers.{i}.{theirs}.weight",)
            if self.spec.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    parts[f"layers.{i}.attn.{norm}.weight"] = (f"model.layers.{i}.self_attn.{norm}.weight",)
            for module in biased_modules(self.spec):
                names = HF_LAYER_LINEARS[module]
                parts[f"layers.{i}.{module}.bias"] = tuple(f"model.layers.{i}.{name}.bias" for name in names)
            for ours, names in self.family.hf_layer_dense.items():
                parts[f"layers.{i}.{ours}"] = tuple(f"model.layers.{i}.{name}" for name in names)
        return parts

    def _expert_parts(self) -> dict[str, list[tuple[str, ...]]]:
        """A mixture of experts' stacked weights -> per expert, the tensors whose rows it concatenates."""
        parts: dict[str, list[tuple[str, ...]]] = {}
        layer_experts = self.family.hf_layer_experts if self.spec.is_moe else {}
        for i in range(self.spec.num_layers):
            for module, names in layer_experts.items():
                if self.family.hf_experts_stacked:  # one tensor for every expert
                    stacked = tuple(self._stacked_name(f"model.layers.{i}.{name}") for name in names)
                    parts[f"layers.{i}.{module}"] = [stacked] * self.spec.num_experts
                    continue
                parts[f"layers.{i}.{module}"] = [
                    tuple(f"model.layers.{i}.{name.format(e=e)}.weight" for name in names)
                    for e in range(self.spec.num_experts)
                ]
        return parts

    def _stacked_name(self, name: str) -> str:
        """A stacked expert tensor's name, or its blocks tensor's where the checkpoint holds blocks."""
        suffixes = self.family.hf_expert_blocks
        if suffixes is None or name in self._where or f"{name}{suffixes[0]}" not in self._where:
            return name
        self._block_scales[f"{name}{suffixes[0]}"] = f"{name}{suffixes[1]}"
        return f"{name}{suffixes[0]}"

    def expert_fp32(self, module: str, expert: int) -> torch.Tensor:
        names = self._expert_names[module][expert]
        if not self.family.hf_experts_stacked:
            return self.fused_fp32(names)
        if names[0] in self._block_scales:  # blocks: their exact values
            rows = self.expert_block_rows(module, expert)
            fmt = self.info(names[0]).block_format
            assert fmt is not None
            return torch.cat([dequantize(part, fmt).reshape(part.shape[0], -1) for part in rows])
        slices = [self._slice(name)[expert] for name in names]  # type: ignore[index]
        return torch.cat([self.family.hf_stacked_expert(n, s.float()) for n, s in zip(names, slices, strict=True)])

    def expert_block_rows(self, module: str, expert: int) -> list[torch.Tensor]:
        """One expert's rows of blocks of each stacked blocks tensor of `module` (gpt-oss's MXFP4)."""
        names = self._expert_names[module][expert]
        if names[0] not in self._block_scales:
            raise ValueError(f"{module}: this checkpoint holds its experts as floats, not blocks")
        parts = []
        for name in names:
            blocks = self._slice(name)[expert]  # type: ignore[index]
            scales = self._slice(self._block_scales[name])[expert]  # type: ignore[index]
            parts.append(self.family.hf_stacked_expert_blocks(name, blocks, scales))
        return parts

    def _slice(self, name: str) -> object:
        return self._files[self._where[name]].get_slice(name)  # type: ignore[attr-defined]

    def info(self, name: str) -> TensorInfo:
        piece = self._slice(name)
        shape = piece.get_shape()  # type: ignore[attr-defined]
        if name in self._block_scales:  # [E, rows, K / block_weights, block's quant bytes]
            assert self.family.hf_expert_blocks is not None
            fmt = self.family.hf_expert_blocks[2]
            scales = int(torch.Size(shape[:-1]).numel())
            cols = int(shape[2]) * block_weights(fmt)
            return TensorInfo(name, fmt.name, int(shape[1]), cols, int(torch.Size(shape).numel()) + scales)
        dtype = piece.get_dtype()  # type: ignore[attr-defined]
        itemsize = {"F32": 4, "F16": 2, "BF16": 2}.get(dtype, 4)
        cols = int(shape[1]) if len(shape) > 1 else int(shape[0])
        rows = int(shape[0]) if len(shape) > 1 else 1
        return TensorInfo(name, dtype, rows, cols, int(torch.Size(shape).numel()) * itemsize)

    def block_rows(self, name: str) -> torch.Tensor:
        raise ValueError(f"{name}: a checkpoint folder holds no GGUF blocks")

    def fp32(self, name: str) -> torch.Tensor:
        tensor = self._files[self._where[name]].get_tensor(name).float()  # type: ignore[attr-defined]
        return self.family.read_hf_tensor(name, tensor)

    def fused_fp32(self, names: tuple[str, ...]) -> torch.Tensor:
        parts = [self.fp32(name) for name in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
