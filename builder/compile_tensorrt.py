"""The TensorRT backend: the step network exported to ONNX, built into a plan with one profile.

Paged attention stays standard ONNX ops (Gather over the block tables, MatMul, Softmax, the
same graph onnxruntime checks in every CI run) rather than a TensorRT plugin: one graph for both
backends and no plugin library to ship per TensorRT version. `make gpu-check` measures the
decode step this produces; a plugin under `plugins/` is the next step only if that measurement
shows attention dominating.

Nothing here imports tensorrt at module level: the CPU path never loads it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from ifb.builder.compiled_step import CompiledStep
from ifb.builder.errors import BuildError, LimitsError
from ifb.builder.export_onnx import export_onnx
from ifb.runtime.engine_format import DTYPE_ALIASES, STEP_INPUTS, EngineLimits, dimension_bounds
from ifb.runtime.step.gpu import tensorrt_unavailable_reason, this_gpu

PLAN_FILE = "step.plan"
TENSORRT_DTYPES = ("bfloat16", "float16", "float32")
Shape = tuple[int, ...]


def require_tensorrt() -> None:
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise BuildError(reason)


def tensorrt_dtype(dtype: str) -> str:
    """`auto` picks bf16 on Ampere and newer (compute capability >= 8.0), fp16 before that."""
    require_tensorrt()
    if dtype == "auto":
        return "bfloat16" if torch.cuda.get_device_capability() >= (8, 0) else "float16"
    normalized = DTYPE_ALIASES.get(dtype)
    if normalized not in TENSORRT_DTYPES:
        raise LimitsError(f"dtype {dtype!r} is not supported by the tensorrt backend; choose auto, bf16, fp16, fp32")
    return normalized


def _opt_sizes(limits: EngineLimits) -> dict[str, int]:
    """The shape TensorRT tunes for: a decode-heavy step (every seat decoding, one chunk joining)."""
    half_table = max(1, limits.max_blocks_per_seq // 2)
    return {
        "num_tokens": min(limits.max_num_tokens, 2 * limits.max_batch_size),
        "num_context": 1,
        "max_chunk_len": min(limits.max_num_tokens, limits.max_batch_size),
        "context_blocks": half_table,
        "num_decode": limits.max_batch_size,
        "decode_blocks": half_table,
        "num_logits": limits.max_batch_size,
    }


def profile_shapes(limits: EngineLimits) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) of every dynamic step input, read straight off the baked limits."""
    bounds = dimension_bounds(limits)
    opt = _opt_sizes(limits)
    return {
        name: (
            tuple(bounds[d][0] for d in dims),
            tuple(min(max(opt[d], bounds[d][0]), bounds[d][1]) for d in dims),
            tuple(bounds[d][1] for d in dims),
        )
        for name, dims in ((tensor.name, tensor.dims) for tensor in STEP_INPUTS)
    }


def _parse_onnx(trt: Any, builder: Any, trt_logger: Any, onnx_path: Path) -> tuple[Any, Any]:
    # parse_from_file (not parse(bytes)): it knows the graph's folder, so it finds the weights'
    # side file; the byte-buffer form would need that folder passed separately.
    # Precision = the ONNX types. TensorRT 11 networks are always strongly typed (no flag left).
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse the exported step graph: {errors}")
    return network, parser


def build_plan(onnx_path: Path, limits: EngineLimits, plan_path: Path, exact_fp32: bool) -> None:
    """Build a serialized TensorRT plan from the ONNX step graph with one optimization profile.
    `exact_fp32` turns TF32 off, so an fp32 plan computes in fp32 as asked."""
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network, _parser = _parse_onnx(trt, builder, trt_logger, onnx_path)  # the parser owns weights: keep it alive
    config = builder.create_builder_config()
    if exact_fp32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profile_shapes(limits).items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError("TensorRT failed to build the step plan; its log above names the layer")
    plan_path.write_bytes(bytes(serialized))


def compile_tensorrt_engine(
    network: torch.nn.Module, limits: EngineLimits, kv_cache: torch.Tensor, folder: Path
) -> CompiledStep:
    """Export ONNX (in a temp dir: only the plan ships) and build `folder/step.plan`."""
    # The graph and its weights side file (`step.onnx.data`) are written side by side in the one
    # scratch folder: parse_from_file resolves external data relative to the graph's folder.
    with tempfile.TemporaryDirectory(prefix="ifb-onnx-") as scratch:
        onnx_path = export_onnx(network, limits, kv_cache, Path(scratch) / "step.onnx")
        build_plan(onnx_path, limits, folder / PLAN_FILE, exact_fp32=kv_cache.dtype == torch.float32)
    return CompiledStep(step_package=PLAN_FILE, tensorrt=this_gpu())
