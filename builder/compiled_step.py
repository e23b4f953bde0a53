"""CompiledStep: what a backend compiler leaves in the engine folder, for engine.json."""

from __future__ import annotations

from dataclasses import dataclass

from ifb.runtime.engine_format import KernelLibraryInfo, LayerChunk, TensorRTPlanInfo


@dataclass(frozen=True, slots=True)
class CompiledStep:
    step_package: str  # relative to the engine folder
    tensorrt: TensorRTPlanInfo | None = None
    kernels: KernelLibraryInfo | None = None
    constants_external: bool = False  # the package holds no weights (EngineConfig.step_constants_external)
    reused: tuple[str, ...] = ()  # the artifacts copied from the compile cache ("kernels", "step")
    layer_chunks: tuple[LayerChunk, ...] = ()  # EngineConfig.layer_chunks (step_package: the head's)
