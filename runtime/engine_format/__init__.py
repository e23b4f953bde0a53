"""The engine format, owned by the runtime: model spec, baked limits, engine.json, the KV pool's
shape and the step-input contract. The builder writes engines by calling this; it never
defines a field of its own."""

from ifb.runtime.engine_format.artifacts import (
    ENGINE_JSON,
    RECORD_SHA256,
    artifact_hashes,
    record_sha256,
    sha256_of_file,
)
from ifb.runtime.engine_format.config import (
    ENGINE_FORMAT_VERSION,
    BackendKind,
    BuildOptionsRecord,
    EngineConfig,
    EngineSource,
    KernelLibraryInfo,
    LayerChunk,
    TensorRTPlanInfo,
)
from ifb.runtime.engine_format.limits import (
    DTYPE_ALIASES,
    DTYPE_BYTES,
    KV_DTYPES,
    KV_Q8_0,
    EngineLimits,
    kv_bytes_per_block,
    kv_format_error,
    kv_pool_dtype,
    kv_pool_shape,
    kv_row_bytes,
    q8_0_block,
)
from ifb.runtime.engine_format.model_spec import Activation, ModelSpec, RouterScoring
from ifb.runtime.engine_format.step_spec import (
    KV_POOLS_ARGUMENT,
    STEP_INPUT_NAMES,
    STEP_INPUTS,
    StepTensor,
    dimension_bounds,
    kv_pool_names,
)

__all__ = [
    "DTYPE_ALIASES",
    "DTYPE_BYTES",
    "ENGINE_FORMAT_VERSION",
    "ENGINE_JSON",
    "KV_DTYPES",
    "KV_POOLS_ARGUMENT",
    "KV_Q8_0",
    "RECORD_SHA256",
    "STEP_INPUTS",
    "STEP_INPUT_NAMES",
    "BackendKind",
    "BuildOptionsRecord",
    "EngineConfig",
    "EngineLimits",
    "EngineSource",
    "KernelLibraryInfo",
    "LayerChunk",
    "Activation",
    "ModelSpec",
    "RouterScoring",
    "StepTensor",
    "TensorRTPlanInfo",
    "artifact_hashes",
    "dimension_bounds",
    "kv_bytes_per_block",
    "kv_format_error",
    "kv_pool_dtype",
    "kv_pool_names",
    "kv_pool_shape",
    "kv_row_bytes",
    "q8_0_block",
    "record_sha256",
    "sha256_of_file",
]
