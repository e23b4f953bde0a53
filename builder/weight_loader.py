"""The network's stored weights, planned from the source's headers and produced module by module.

`plan_weights` decides, from tensor headers alone, what each weight becomes (`--weights`):
  auto  a GGUF's blocks are kept in their own format wherever a kernel reads it — per part of a
        fused module when its parts differ (Q4_K_M: Q4_K q/k beside a Q6_K v) — and the rest is
        dequantized to fp32, with one warning naming the tensors and the bytes it costs; a
        checkpoint folder stays dense;
  qX    every linear quantized from fp32 (round-to-nearest per 32-weight block);
  fp32  nothing kept as blocks.
A block-format token embedding is read as block rows (tied: the head's own tiles), never an fp32
vocabulary table. `network_state` then yields the stored tensors one module at a time from the
mapped source, so the build holds the engine's weights plus one module in flight; a linear's
blocks come as `PackedTiles`, packed only as they are written (`write_into`), a chunk at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ifb.builder.gguf_tensors import TensorInfo
from ifb.builder.read_ahead import read_ahead
from ifb.plugins.quant_formats import BLOCK_SIZE, WeightCompute, WeightFormat, block_weights, quantize
from ifb.plugins.quant_pack import pack_tiles, pack_tiles_into
from ifb.runtime.engine_format import ModelSpec
from ifb.runtime.engine_format.weights_file import WeightsWriter
from ifb.runtime.step.network import EMBED_KEY, linear_part_rows
from ifb.runtime.step.quant_linear import PACKERS, packed_shape
from ifb.runtime.step.segmented_linear import part_formats, part_key, segment_parts

logger = logging.getLogger(__name__)

# quant_ops.pack / pack_int8: rows of blocks, or a fused module's parts of them
Packer = Callable[[torch.Tensor | Sequence[torch.Tensor], WeightFormat, int, int], torch.Tensor]


class TensorSource(Protocol):
    """A model file's tensors under our names (gguf_tensors.GgufTensors, checkpoint_tensors.CheckpointTensors)."""

    spec: ModelSpec
    linears: dict[str, tuple[str, ...]]  # our linear module -> source tensors fused in row order
    dense: dict[str, tuple[str, ...]]  # our norm/bias/embedding tensor -> source tensors
    experts: dict[str, tuple[str, ...]]  # our stacked expert weight -> every source tensor it reads

    def info(self, name: str) -> TensorInfo: ...

    def expert_fp32(self, module: str, expert: int) -> torch.Tensor: ...

    def expert_block_rows(self, module: str, expert: int) -> list[torch.Tensor]: ...

    def block_rows(self, name: str) -> torch.Tensor: ...

    def fused_fp32(self, names: tuple[str, ...]) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class PackedTiles:
    """A linear's rows of blocks (or a fused module's parts of them) as the packer's tiles, not yet packed."""

    rows: torch.Tensor | tuple[torch.Tensor, ...]
    fmt: WeightFormat
    n: int
    k: int
    int8_layout: bool

    @property
    def source_bytes(self) -> int:
        parts = (self.rows,) if isinstance(self.rows, torch.Tensor) else self.rows
        return sum(part.numel() for part in parts)

    def tensor(self) -> torch.Tensor:
        """The tiles in memory (what `quant_ops.pack` / `pack_int8` return)."""
        return pack_tiles(self.rows, self.fmt, self.n, self.k, self.int8_layout)

    def write_into(self, writer: WeightsWriter, name: str) -> None:
        """The tiles into `writer` as `name`, packed chunk by chunk into reused buffers (never whole
        in memory: see `pack_tiles_into`)."""
        shape = packed_shape(self.fmt, self.n, self.k)
        if writer.entries[name].shape != shape:
            raise ValueError(f"{name}: shape {shape}, the file expects {writer.entries[name].shape}")

        def write(offset: int, tiles: np.ndarray) -> None:
            writer.write_at(name, offset, tiles.data)

        pack_tiles_into(self.rows, self.fmt, self.n, self.k, self.int8_layout, write)


Stored = torch.Tensor | PackedTiles  # what `network_state` yields per stored name


@dataclass(frozen=True, slots=True)
class WeightPlan:
    """What the engine stores: StepNetwork.weight_formats, and the source tensors dequantized."""

    formats: dict[str, WeightFormat]
    dequantized: tuple[TensorInfo, ...]  # block-quantized in the file, no kernel: stored dense
    quantized_from: str | None  # the --weights format every linear was quantized to, if any
    # 16-bit float tensors the engine stores in its dtype (fp32 beside block weights: no kernel
    # multiplies an F16/BF16 matrix, and norms and biases are added in the activations' dtype)
    sixteen_bit: tuple[TensorInfo, ...] = ()

    @property
    def has_blocks(self) -> bool:
        # a mixture of experts records its dense ("fp32") experts too: they bring the kernel library
        return any(fmt.is_block for fmt in self.formats.values())


def plan_weights(source: TensorSource, weights: str) -> WeightPlan:
    """The plan for `--weights` (auto, fp32, q8_0|q4_1|q4_0), from headers only."""
    if weights == "fp32":
        return WeightPlan(dict.fromkeys(source.experts, WeightFormat.FP32), _non_dense(source, lambda info: True), None)
    if weights != "auto":
        return _quantize_plan(source, WeightFormat(weights))
    formats: dict[str, WeightFormat] = {}
    for module, names in source.linears.items():
        kept = [source.info(name).block_format or WeightFormat.FP32 for name in names]
        if all(fmt is kept[0] for fmt in kept):
            if kept[0] is not WeightFormat.FP32:
                formats[module] = kept[0]
        else:
            formats.update({part_key(module, i): fmt for i, fmt in enumerate(kept)})
    embed = source.info(source.dense["embed.weight"][0]).block_format
    if embed is not None:
        formats[EMBED_KEY] = embed
    for module, names in source.experts.items():  # kept where every part is one format a kernel reads
        expert_kinds = {source.info(name).block_format for name in names}
        only = expert_kinds.pop() if len(expert_kinds) == 1 else None
        formats[module] = only if only is not None else WeightFormat.FP32
    sixteen_bit = tuple(info for info in _source_infos(source) if info.type_name in ("F16", "BF16"))
    # an expert tensor of a kernel's format is stored dense where its stacked weight mixes formats
    unkept = {name for module, names in source.experts.items() if not formats[module].is_block for name in names}
    dequantized = _non_dense(source, lambda info: info.block_format is None or info.name in unkept)
    return WeightPlan(formats, dequantized, None, sixteen_bit)


def _quantize_plan(source: TensorSource, fmt: WeightFormat) -> WeightPlan:
    formats: dict[str, WeightFormat] = {}
    unaligned: list[str] = []
    for module, names in source.linears.items():
        cols = source.info(names[0]).cols
        if cols % BLOCK_SIZE:
            unaligned.append(f"{module} (K={cols})")
        else:
            formats[module] = fmt
    for module, names in source.experts.items():
        cols = source.info(names[0]).cols
        formats[module] = WeightFormat.FP32 if cols % block_weights(fmt) else fmt
        if cols % block_weights(fmt):
            unaligned.append(f"{module} (K={cols})")
    if unaligned:
        logger.warning(
            "%d weight(s) stay fp32: K is not a multiple of %d: %s", len(unaligned), BLOCK_SIZE, ", ".join(unaligned)
        )
    if source.spec.tie_word_embeddings and "lm_head" in formats:
        formats[EMBED_KEY] = fmt  # the embedding reads the head's tiles
    return WeightPlan(formats, (), fmt.value)


def _non_dense(source: TensorSource, keep: Callable[[TensorInfo], bool]) -> tuple[TensorInfo, ...]:
    """The distinct source tensors that are neither dense nor kept (so dequantized), in file order."""
    return tuple(info for info in _source_infos(source) if not info.is_dense and keep(info))


def _source_infos(source: TensorSource) -> list[TensorInfo]:
    """Every distinct source tensor the network takes, in the order its modules name them."""
    every = (*source.linears.values(), *source.dense.values(), *source.experts.values())
    names = dict.fromkeys(name for names in every for name in names)
    return [source.info(name) for name in names]


def warn_dequantized(plan: WeightPlan, dtype_bytes: int) -> None:
    """One warning for every block tensor stored dense, and one for the 16-bit tensors of a
    block-quantized file widened to the engine's dtype, each with what it costs."""
    if plan.has_blocks and dtype_bytes > 2 and plan.sixteen_bit:
        widened = plan.sixteen_bit
        logger.warning(
            "%d F16/BF16 source tensor(s) are widened to %d-byte floats beside the block weights (no kernel reads "
            "16-bit matrices): %.2f MB in the file -> %.2f MB in the engine: %s",
            len(widened),
            dtype_bytes,
            sum(info.file_bytes for info in widened) / 1e6,
            sum(info.rows * info.cols * dtype_bytes for info in widened) / 1e6,
            ", ".join(f"{info.name} ({info.type_name}, {info.rows}x{info.cols})" for info in widened),
        )
    if not plan.dequantized:
        return
    file_bytes = sum(info.file_bytes for info in plan.dequantized)
    dense_bytes = sum(info.rows * info.cols * dtype_bytes for info in plan.dequantized)
    kinds = sorted({info.type_name for info in plan.dequantized})
    logger.warning(
        "%d source tensor(s) in %s have no kernel here and are stored dequantized (%.1f MB in the file -> "
        "%.1f MB in the engine): %s",
        len(plan.dequantized),
        "/".join(kinds),
        file_bytes / 1e6,
        dense_bytes / 1e6,
        ", ".join(f"{info.name} ({info.type_name})" for info in plan.dequantized),
    )


def network_state(source: TensorSource, plan: WeightPlan, compute: WeightCompute) -> Iterator[tuple[str, Stored]]:
    """The network's stored tensors, one module at a time (fp32 for dense ones, `PackedTiles` for a
    linear's blocks), each read on a worker thread while the caller writes the one before
    (builder/read_ahead.py)."""
    return read_ahead(_network_state(source, plan, compute), lambda item: _held_bytes(item[1]))


def _held_bytes(value: Stored) -> int:
    if isinstance(value, PackedTiles):
        return value.source_bytes
    return value.numel() * value.element_size()


def _network_state(source: TensorSource, plan: WeightPlan, compute: WeightCompute) -> Iterator[tuple[str, Stored]]:
    spec = source.spec
    packer = PACKERS[compute]
    int8_layout = compute is WeightCompute.INT8
    for module in linear_part_rows(spec):
        names = source.linears[module]
        per_part = part_formats(plan.formats, module, len(names))
        if per_part is not None:
            for index, parts in enumerate(segment_parts(per_part)):
                segment = tuple(names[i] for i in parts)
                yield from _stored_linear(
                    source, f"{module}.parts.{index}", per_part[parts[0]], segment, int8_layout, plan
                )
            continue
        fmt = plan.formats.get(module, WeightFormat.FP32)
        if module == "lm_head" and spec.tie_word_embeddings and fmt is WeightFormat.FP32:
            continue  # the network ties a dense head to the embedding table
        yield from _stored_linear(source, module, fmt, names, int8_layout, plan)
    for module in source.experts:
        yield module, _stored_experts(source, module, plan.formats[module], packer, plan)
    for name, parts in source.dense.items():
        if name == "embed.weight" and EMBED_KEY in plan.formats:
            yield from _stored_embedding(source, plan, parts[0])
        else:
            yield name, source.fused_fp32(parts)


def _stored_linear(
    source: TensorSource,
    module: str,
    fmt: WeightFormat,
    names: tuple[str, ...],
    int8_layout: bool,
    plan: WeightPlan,
) -> Iterator[tuple[str, Stored]]:
    if fmt is WeightFormat.FP32:
        yield f"{module}.weight", source.fused_fp32(names)
        return
    rows: torch.Tensor | tuple[torch.Tensor, ...]
    if plan.quantized_from is not None:
        rows = quantize(source.fused_fp32(names), fmt)
    else:  # a fused module's parts are packed as one, never concatenated (a copy of every weight)
        rows = tuple(source.block_rows(name) for name in names)
    n = sum(source.info(name).rows for name in names)
    k = source.info(names[0]).cols
    yield f"{module}.packed", PackedTiles(rows, fmt, n, k, int8_layout)


def _stored_experts(
    source: TensorSource, module: str, fmt: WeightFormat, packer: Packer, plan: WeightPlan
) -> torch.Tensor:
    """A stacked expert weight: fp32 [E, n, k], or every expert packed as one linear [E, tiles, bytes]."""
    experts = []
    for expert in range(source.spec.num_experts):
        if fmt is WeightFormat.FP32:
            experts.append(source.expert_fp32(module, expert))
            continue
        rows: torch.Tensor | list[torch.Tensor]
        if plan.quantized_from is not None:
            weight = source.expert_fp32(module, expert)
            rows, (n, k) = quantize(weight, fmt), weight.shape
        else:
            rows = source.expert_block_rows(module, expert)
            n, k = sum(part.shape[0] for part in rows), source.info(source.experts[module][0]).cols
        experts.append(packer(rows, fmt, n, k))
    return torch.stack(experts)


def _stored_embedding(source: TensorSource, plan: WeightPlan, name: str) -> Iterator[tuple[str, Stored]]:
    """The embedding's own tiles, unless it reads the tied head's (then nothing to store)."""
    fmt = plan.formats[EMBED_KEY]
    if source.spec.tie_word_embeddings and plan.formats.get("lm_head") is fmt:
        return
    info = source.info(name)
    if info.cols % block_weights(fmt):
        raise ValueError(f"{name}: {info.cols} columns is not a multiple of {fmt.value}'s block")
    yield "embed.packed", PackedTiles(source.block_rows(name), fmt, info.rows, info.cols, int8_layout=False)
