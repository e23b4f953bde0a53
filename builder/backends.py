"""Backend compilers: what each `--backend` makes of the converted network, chosen in one factory."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch

from ifb.builder.compile_cpu import compile_cpu_engine
from ifb.builder.compile_tensorrt import compile_tensorrt_engine, tensorrt_dtype
from ifb.builder.limits import EngineLimits, normalize_dtype
from ifb.builder.network import StepNetwork

STEP_PACKAGE = "step.pt2"


class Backend(str, Enum):
    CPU = "cpu"
    TENSORRT = "tensorrt"


class BackendCompiler(Protocol):
    def resolve_dtype(self, dtype: str) -> str:
        """`auto` or an alias -> the dtype this backend builds; raises BuildError if unusable."""
        ...

    def compile(
        self, network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, folder: Path
    ) -> dict[str, Any]:
        """Write the step artifact into `folder`; return its engine.json fields."""
        ...


class CpuCompiler:
    def resolve_dtype(self, dtype: str) -> str:
        return normalize_dtype(dtype)

    def compile(
        self, network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, folder: Path
    ) -> dict[str, Any]:
        compile_cpu_engine(network, limits, kv_cache, folder / STEP_PACKAGE)
        return {"step_package": STEP_PACKAGE}


class TensorRTCompiler:
    """compile_tensorrt imports tensorrt (and onnx) only inside its build functions."""

    def resolve_dtype(self, dtype: str) -> str:
        return tensorrt_dtype(dtype)

    def compile(
        self, network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, folder: Path
    ) -> dict[str, Any]:
        return compile_tensorrt_engine(network, limits, kv_cache, folder)


def compiler_for(backend: Backend) -> BackendCompiler:
    compilers: dict[Backend, BackendCompiler] = {Backend.CPU: CpuCompiler(), Backend.TENSORRT: TensorRTCompiler()}
    return compilers[backend]
