"""Backend compilers: what each `--backend` makes of the converted network, chosen in one factory."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ifb.builder.compile_cpu import build_engine_kernels, compile_cpu_engine
from ifb.builder.compile_tensorrt import compile_tensorrt_engine, tensorrt_dtype
from ifb.builder.compiled_step import CompiledStep
from ifb.builder.limits import normalize_dtype
from ifb.runtime.engine_format import BackendKind, EngineLimits
from ifb.runtime.step.network import StepNetwork

STEP_PACKAGE = "step.pt2"
Backend = BackendKind  # the builder's name for it (`ifb build --backend`)


class BackendCompiler(Protocol):
    def resolve_dtype(self, dtype: str) -> str:
        """`auto` or an alias -> the dtype this backend builds; raises BuildError if unusable."""
        ...

    def compile(self, network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, folder: Path) -> CompiledStep:
        """Write the step artifact into `folder`."""
        ...


class CpuCompiler:
    def resolve_dtype(self, dtype: str) -> str:
        return normalize_dtype(dtype)

    def compile(self, network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, folder: Path) -> CompiledStep:
        kernels = build_engine_kernels(folder) if network.weight_formats else None
        # Block engines bind their weights from the weights file at load, so they are stored once;
        # dense ones keep freezing's prepacked (MKL/oneDNN) constants inside the package.
        external = bool(network.weight_formats)
        compile_cpu_engine(network, limits, kv_cache, folder / STEP_PACKAGE, constants_in_package=not external)
        return CompiledStep(step_package=STEP_PACKAGE, kernels=kernels, constants_external=external)


class TensorRTCompiler:
    """compile_tensorrt imports tensorrt (and onnx) only inside its build functions."""

    def resolve_dtype(self, dtype: str) -> str:
        return tensorrt_dtype(dtype)

    def compile(self, network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, folder: Path) -> CompiledStep:
        return compile_tensorrt_engine(network, limits, kv_cache, folder)


def compiler_for(backend: BackendKind) -> BackendCompiler:
    compilers: dict[BackendKind, BackendCompiler] = {
        BackendKind.CPU: CpuCompiler(),
        BackendKind.TENSORRT: TensorRTCompiler(),
    }
    return compilers[backend]
