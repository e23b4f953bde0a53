"""`--weights` and `--compute`: the option checks and what they resolve to on this machine.

What each weight becomes is planned in weight_loader.py; this file refuses option pairs no
backend can build and picks `--compute auto`'s mode.
"""

from __future__ import annotations

import json
from pathlib import Path

from ifb.builder.checkpoint_tensors import has_block_experts
from ifb.builder.errors import BuildError
from ifb.builder.gguf_fields import read_gguf_header
from ifb.builder.sources import ModelSource, SourceKind
from ifb.plugins.quant_build import QuantIsa, QuantLibraryError, best_isa, cpu_features
from ifb.plugins.quant_formats import GGUF_TYPE_NAMES, QUANTIZE_FORMATS, WeightCompute, WeightFormat
from ifb.runtime.engine_format import BackendKind

# `--weights`: the block formats the builder quantizes a source to come from the enum (q8_0, q4_1, q4_0).
BLOCK_CHOICES: tuple[str, ...] = tuple(fmt.value for fmt in QUANTIZE_FORMATS)
WEIGHT_CHOICES: tuple[str, ...] = ("auto", WeightFormat.FP32.value, *BLOCK_CHOICES)
AUTO_COMPUTE = "auto"
COMPUTE_CHOICES = (AUTO_COMPUTE, *(mode.value for mode in WeightCompute))
# The kernel paths on which int8 compute beat the exact mode when measured (bench/README.md):
# AVX2 maddubs 1.50x llama-server alone vs 1.12x exact; AVX-512 VNNI the layers 2.7x at 32 rows and
# 2.9x at 512; AVX-512 without VNNI runs the same maddubs path at twice the width.
INT8_PAYS_ON = frozenset({QuantIsa.AVX2, QuantIsa.AVX512, QuantIsa.AVX512_VNNI})


def int8_compute_pays(features: frozenset[str]) -> bool:
    """Whether `--compute auto` picks int8 on a CPU with these /proc/cpuinfo flags."""
    try:
        return best_isa(features) in INT8_PAYS_ON
    except QuantLibraryError:
        return False


def check_weights_option(weights: str, backend: BackendKind) -> None:
    """Refuse what no backend can build, before any work."""
    if weights not in WEIGHT_CHOICES:
        raise BuildError(f"--weights {weights!r} is not one of {', '.join(WEIGHT_CHOICES)}")
    if weights in BLOCK_CHOICES and backend is not BackendKind.CPU:
        raise BuildError(
            f"--weights {weights} needs --backend cpu: the {backend.value} backend stores fp32/bf16 weights"
        )


def resolve_compute(compute: str, has_blocks: bool) -> WeightCompute:
    """`--compute` as a mode: auto = int8 where block weights exist and this CPU's integer dots pay
    (a GGUF's blocks were made for llama.cpp, which always pairs them with int8 activations),
    else fp32; int8 is refused without block weights."""
    if compute not in COMPUTE_CHOICES:
        raise BuildError(f"--compute {compute!r} is not one of {', '.join(COMPUTE_CHOICES)}")
    if compute == AUTO_COMPUTE:
        return WeightCompute.INT8 if has_blocks and int8_compute_pays(cpu_features()) else WeightCompute.FP32
    mode = WeightCompute(compute)
    if mode is WeightCompute.INT8 and not has_blocks:
        raise BuildError(
            "--compute int8 needs block-quantized weights: build a GGUF source holding block-quantized tensors "
            f"with --weights auto, or quantize with --weights {'|'.join(BLOCK_CHOICES)}"
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
    if source.kind is SourceKind.GGUF:
        return has_block_tensors(source.path)
    return has_block_experts(source.path, str(json.loads((source.path / "config.json").read_text()).get("model_type")))


def has_block_tensors(path: Path) -> bool:
    """True when some 2-D weight of the GGUF file is in a format our kernels read (the tensor table only:
    gguf's GGUFReader would parse the whole vocabulary, 17 s for 262k tokens)."""
    tensors = read_gguf_header(path, lambda key: False).tensors
    return any(t.tensor_type.name in GGUF_TYPE_NAMES for t in tensors if t.name.endswith(".weight"))
