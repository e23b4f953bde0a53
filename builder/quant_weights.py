"""`--weights`: which linear layers an engine stores as GGUF blocks, and the blocks themselves.

`auto` keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks (checked bit for bit against the fp32 weights
transformers' GGUF loader produced) and an HF checkpoint's fp32; `q8_0|q4_1|q4_0` quantize every
linear layer from the fp32 weights (round-to-nearest per 32-weight block); `fp32` packs nothing.
The input embedding is a gather and stays an fp32 table; with tied embeddings the LM head keeps
the blocks and the embedding becomes their exact dequantization, so both read the same weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ifb.builder.errors import BuildError
from ifb.builder.gguf_blocks import has_block_linears, module_parts, read_module_blocks
from ifb.builder.sources import ModelSource, SourceKind
from ifb.plugins.quant_formats import BLOCK_SIZE, WeightCompute, WeightFormat, dequantize, quantize
from ifb.runtime.engine_format import BackendKind, ModelSpec
from ifb.runtime.step.quant_linear import PACKERS

logger = logging.getLogger(__name__)

WEIGHT_CHOICES = ("auto", "fp32", "q8_0", "q4_1", "q4_0")
BLOCK_CHOICES = ("q8_0", "q4_1", "q4_0")
COMPUTE_CHOICES = tuple(mode.value for mode in WeightCompute)


@dataclass(frozen=True, slots=True)
class PackedWeights:
    """module name -> (format, GGUF block rows uint8 [n, k/32 * block bytes]); empty = all fp32."""

    blocks: dict[str, tuple[WeightFormat, torch.Tensor]]

    @property
    def formats(self) -> dict[str, str]:
        return {module: fmt.value for module, (fmt, _) in self.blocks.items()}


def check_weights_option(weights: str, backend: BackendKind) -> None:
    """Refuse what no backend can build, before any work."""
    if weights not in WEIGHT_CHOICES:
        raise BuildError(f"--weights {weights!r} is not one of {', '.join(WEIGHT_CHOICES)}")
    if weights in BLOCK_CHOICES and backend is not BackendKind.CPU:
        raise BuildError(
            f"--weights {weights} needs --backend cpu: the {backend.value} backend stores fp32/bf16 weights"
        )


def check_compute_option(compute: str, packed: PackedWeights) -> WeightCompute:
    """`--compute` names a mode, and int8 only where some layer is stored as blocks."""
    if compute not in COMPUTE_CHOICES:
        raise BuildError(f"--compute {compute!r} is not one of {', '.join(COMPUTE_CHOICES)}")
    mode = WeightCompute(compute)
    if mode is WeightCompute.INT8 and not packed.blocks:
        raise BuildError(
            "--compute int8 needs block-quantized weights: build a GGUF source holding Q4_0/Q4_1/Q8_0 tensors "
            "with --weights auto, or quantize with --weights q8_0|q4_1|q4_0"
        )
    return mode


def packed_dtype(requested: str, resolved: str, weights: str) -> str:
    """The dtype an engine with packed weights builds with: fp32 activations, whatever `auto` said."""
    if resolved == "float32" or requested == "auto":
        return "float32"
    raise BuildError(
        f"--dtype {requested} cannot be used with block-quantized weights (--weights {weights}): "
        "use --dtype float32 (or auto), or --weights fp32"
    )


def source_packs_weights(source: ModelSource, weights: str, backend: BackendKind) -> bool:
    """Whether building `source` with `weights` stores some weight as blocks (header read only)."""
    if backend is not BackendKind.CPU or weights == "fp32":
        return False
    if weights in BLOCK_CHOICES:
        return True
    return source.kind is SourceKind.GGUF and has_block_linears(source.path)


def linear_modules(spec: ModelSpec) -> list[str]:
    return list(module_parts(spec, set()))


def pack_weights(
    source: ModelSource, spec: ModelSpec, state: dict[str, torch.Tensor], weights: str, backend: BackendKind
) -> PackedWeights:
    """The blocks an engine stores for `weights`; warns once about what stays fp32."""
    if not source_packs_weights(source, weights, backend):
        return PackedWeights({})
    if weights in BLOCK_CHOICES:
        return _quantized(spec, state, WeightFormat(weights))
    found = read_module_blocks(source.path, spec)
    _check_gguf_blocks(found.blocks, state)
    if found.skipped:
        logger.warning(
            "%d GGUF weight(s) are not Q4_0/Q4_1/Q8_0 (or a fused group mixes formats) and are stored "
            "dequantized to fp32: %s",
            len(found.skipped),
            ", ".join(found.skipped),
        )
    return PackedWeights(found.blocks)


def _quantized(spec: ModelSpec, state: dict[str, torch.Tensor], fmt: WeightFormat) -> PackedWeights:
    blocks: dict[str, tuple[WeightFormat, torch.Tensor]] = {}
    unaligned: list[str] = []
    for module in linear_modules(spec):
        weight = state[f"{module}.weight"]
        if weight.shape[1] % BLOCK_SIZE:
            unaligned.append(f"{module} (K={weight.shape[1]})")
        else:
            blocks[module] = (fmt, quantize(weight, fmt))
    if unaligned:
        logger.warning(
            "%d weight(s) stay fp32: K is not a multiple of %d: %s", len(unaligned), BLOCK_SIZE, ", ".join(unaligned)
        )
    return PackedWeights(blocks)


def _check_gguf_blocks(blocks: dict[str, tuple[WeightFormat, torch.Tensor]], state: dict[str, torch.Tensor]) -> None:
    """Each module's blocks must dequantize to exactly the fp32 weight transformers loaded."""
    for module, (fmt, rows) in blocks.items():
        expected = state[f"{module}.weight"]
        got = dequantize(rows, fmt)
        if got.shape != expected.shape or not torch.equal(got, expected):
            diff = (got - expected).abs().max().item() if got.shape == expected.shape else float("nan")
            raise BuildError(
                f"the {fmt.value} blocks of {module} do not dequantize to the weights transformers' GGUF loader "
                f"produced (shape {tuple(got.shape)} vs {tuple(expected.shape)}, max diff {diff}); "
                "build with --weights fp32"
            )


def apply_packed_weights(
    state: dict[str, torch.Tensor], packed: PackedWeights, spec: ModelSpec, compute: WeightCompute
) -> dict[str, torch.Tensor]:
    """The network state dict with each packed module's `.weight` replaced by its `.packed` tiles,
    laid out for `compute`'s kernel."""
    out = dict(state)
    for module, (fmt, rows) in packed.blocks.items():
        n, k = out.pop(f"{module}.weight").shape
        out[f"{module}.packed"] = PACKERS[compute](rows, fmt, n, k)
        if module == "lm_head" and spec.tie_word_embeddings:
            out["embed.weight"] = dequantize(rows, fmt)
    return out
