"""Backend compilers: what each `--backend` makes of the converted network, chosen in one factory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch

from ifb.builder.artifact_cache import ArtifactCache
from ifb.builder.compile_cpu import HelperFactory, build_engine_kernels, compile_cpu_engine, compile_layer_chunks
from ifb.builder.compile_tensorrt import compile_tensorrt_engine, tensorrt_dtype
from ifb.builder.compiled_step import CompiledStep
from ifb.builder.engine_writer import ensure_free_space
from ifb.builder.layer_chunk_plan import LayerChunking, plan_for
from ifb.builder.limits import normalize_dtype
from ifb.runtime.engine_format import BackendKind, EngineLimits
from ifb.runtime.step.network import StepNetwork

logger = logging.getLogger(__name__)

STEP_PACKAGE = "step.pt2"
# Room for a .pt2's compiled code beyond its constants (the tiny test engine's is ~2 MB).
STEP_CODE_BYTES = 32 * 2**20
Backend = BackendKind  # the builder's name for it (`ifb build --backend`)


class BackendCompiler(Protocol):
    def resolve_dtype(self, dtype: str) -> str:
        """`auto` or an alias -> the dtype this backend builds; raises BuildError if unusable."""
        ...

    def compile(
        self,
        network: StepNetwork,
        limits: EngineLimits,
        kv_cache: torch.Tensor,
        folder: Path,
        cache: ArtifactCache | None,
        chunking: LayerChunking = LayerChunking.AUTO,
        start_helper: HelperFactory | None = None,
    ) -> CompiledStep:
        """Write the step artifact into `folder`, copying what `cache` holds for the same code;
        `chunking`: whether its layers may compile as chunks (builder/layer_chunk_plan.py);
        `start_helper`: a second process for some of the chunks' packages (builder/package_helper.py)."""
        ...


class CpuCompiler:
    def resolve_dtype(self, dtype: str) -> str:
        return normalize_dtype(dtype)

    def compile(
        self,
        network: StepNetwork,
        limits: EngineLimits,
        kv_cache: torch.Tensor,
        folder: Path,
        cache: ArtifactCache | None,
        chunking: LayerChunking = LayerChunking.AUTO,
        start_helper: HelperFactory | None = None,
    ) -> CompiledStep:
        reused: list[str] = []
        kernels = None
        if network.weight_formats:
            kernels, kernels_reused = build_engine_kernels(folder, cache)
            reused += ["kernels"] if kernels_reused else []
        # Block engines bind their weights from the weights file at load, so they are stored once;
        # dense ones keep freezing's prepacked (MKL/oneDNN) constants inside the package.
        external = bool(network.weight_formats)
        plan = plan_for(network, chunking, 1 if start_helper is None else 2) if external else None
        if plan is not None:
            logger.info(
                "the step compiles as %d chunks of layers %s (%d distinct) and the head",
                len(plan.chunks),
                [count for _, count in plan.chunks],
                plan.num_packages,
            )
            ensure_free_space(folder, STEP_CODE_BYTES * (plan.num_packages + 1), "layer chunk packages")
            chunks, head, num_reused = compile_layer_chunks(
                network, plan, limits, kv_cache, folder, cache, kernels, start_helper
            )
            reused += ["step"] * bool(num_reused)
            return CompiledStep(
                head, kernels=kernels, constants_external=True, reused=tuple(reused), layer_chunks=chunks
            )
        ensure_free_space(folder, _step_package_bytes(network, external), STEP_PACKAGE)
        package = folder / STEP_PACKAGE
        if compile_cpu_engine(network, limits, kv_cache, package, not external, cache, kernels):
            reused.append("step")
        return CompiledStep(STEP_PACKAGE, kernels=kernels, constants_external=external, reused=tuple(reused))


class TensorRTCompiler:
    """compile_tensorrt imports tensorrt (and onnx) only inside its build functions."""

    def resolve_dtype(self, dtype: str) -> str:
        return tensorrt_dtype(dtype)

    def compile(
        self,
        network: StepNetwork,
        limits: EngineLimits,
        kv_cache: torch.Tensor,
        folder: Path,
        cache: ArtifactCache | None,
        chunking: LayerChunking = LayerChunking.AUTO,
        start_helper: HelperFactory | None = None,
    ) -> CompiledStep:
        return compile_tensorrt_engine(network, limits, kv_cache, folder)  # a TensorRT plan holds its weights


def _step_package_bytes(network: StepNetwork, constants_external: bool) -> int:
    """About what step.pt2 will take: its code, plus the network's tensors when the package holds
    them (a tied head counted twice, as freezing may store it so: SmolLM2's 331 MB package against
    269 MB of weights)."""
    if constants_external:
        return STEP_CODE_BYTES
    tensors = network.state_dict().values()
    return STEP_CODE_BYTES + sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def compiler_for(backend: BackendKind) -> BackendCompiler:
    compilers: dict[BackendKind, BackendCompiler] = {
        BackendKind.CPU: CpuCompiler(),
        BackendKind.TENSORRT: TensorRTCompiler(),
    }
    return compilers[backend]
