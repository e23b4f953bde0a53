"""EngineConfig: engine.json as one typed record, written by the builder and read by the runtime.

The runtime owns this schema. `to_json` is the only writer and `load` the only reader, so a
field is added in one place; unknown or missing fields and paths leaving the engine folder are
refused with the file and the field named, and a record whose seal (`record_sha256`) does not
match its fields is refused as corrupted.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from ifb.plugins.quant_formats import WeightCompute, WeightFormat
from ifb.runtime.engine_format.artifacts import (
    ENGINE_JSON,
    RECORD_SHA256,
    confined_path,
    record_sha256,
    verify_artifacts,
    verify_record,
)
from ifb.runtime.engine_format.limits import KV_DTYPES, EngineLimits, kv_bytes_per_block, kv_pool_shape
from ifb.runtime.engine_format.model_spec import ModelSpec
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step_budget.cost_model import StepCostModel

ENGINE_FORMAT_VERSION = 2  # 2: typed record with build_id, build_options and kernel/tensorrt sections
# What a stored weight may be (the one enum, plugins/quant_formats.py): `weight_formats` is an
# optional field, so a version-2 engine without it has every weight in `dtype`; "fp32" appears only
# for one part of a mixed-format fused module (`layers.0.attn.qkv[2]`, runtime/step/segmented_linear.py).
STORED_WEIGHT_FORMATS = tuple(fmt.value for fmt in WeightFormat)
# How those layers multiply (WeightCompute); absent = fp32, the exact mode.
WEIGHT_COMPUTE_MODES = tuple(mode.value for mode in WeightCompute)


class BackendKind(str, Enum):
    """What runs an engine's compiled step; the value is `ifb build --backend`'s."""

    CPU = "cpu"
    TENSORRT = "tensorrt"


@dataclass(frozen=True, slots=True)
class EngineSource:
    kind: str  # hf_folder | gguf | default
    path: str
    sha256: str


@dataclass(frozen=True, slots=True)
class TensorRTPlanInfo:
    """What a TensorRT plan is tied to: it runs only on the same TensorRT version and GPU."""

    version: str
    gpu_name: str
    compute_capability: str


@dataclass(frozen=True, slots=True)
class KernelLibraryInfo:
    """The engine's own weight kernels (plugins/), compiled for the building CPU's ISA."""

    path: str
    isa: str
    cpu_features: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LayerChunk:
    """One run of decoder layers [first_layer, first_layer + num_layers) of a layer-chunked step,
    run by `package` (runtime/step/layer_chunks.py); one package serves every run of alike layers."""

    package: str
    first_layer: int
    num_layers: int


@dataclass(frozen=True, slots=True)
class BuildOptionsRecord:
    """The `ifb build` options as resolved, so a rebuild hint can reproduce every one of them."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    block_size: int
    kv_blocks: int
    dtype: str
    backend: str
    weights: str = "auto"
    kv_dtype: str = "auto"  # auto = the engine's dtype (also what engines built before the option hold)
    compute: str = "fp32"  # `--compute`: how block-quantized layers multiply
    layer_chunks: str = "auto"  # `--layer-chunks` (auto: also what engines built before the option hold)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model_name: str
    spec: ModelSpec
    limits: EngineLimits
    dtype: str  # what the step computes in
    kv_dtype: str  # what the KV pool stores (`--kv-dtype`); absent from older engine.json = dtype
    backend: BackendKind
    rope_scaling: float
    step_package: str
    weights: str
    tokenizer_folder: str
    has_chat_template: bool
    source: EngineSource
    build_id: str
    builder_version: str
    build_options: BuildOptionsRecord
    # timings, versions, cpu: informational, but for serving_cost_model.REUSE_STORED_KEY
    build_info: dict[str, Any] = field(default_factory=dict)
    tensorrt: TensorRTPlanInfo | None = None
    kernels: KernelLibraryInfo | None = None
    weight_formats: dict[str, WeightFormat] = field(default_factory=dict)  # module name -> block format
    # how the block-format layers multiply: fp32 or int8 (`--compute`)
    weight_compute: WeightCompute = WeightCompute.FP32
    # True: the step package holds no weights; they are bound at load from the mapped weights file,
    # so an engine stores them once (block engines; dense ones keep freezing's prepacked constants).
    step_constants_external: bool = False
    cost_model: StepCostModel | None = None  # measured at the end of the build on the building machine
    # Empty: `step_package` is the whole step. Otherwise the step embeds eagerly, runs these in layer
    # order, and `step_package` is the head's (runtime/step/chunked_step.py).
    layer_chunks: tuple[LayerChunk, ...] = ()
    artifacts: dict[str, str] = field(default_factory=dict)
    folder: Path = Path(".")  # where it was loaded from; not part of the record

    # -- paths inside the engine folder ------------------------------------------------------
    def path(self, relative: str, what: str) -> Path:
        return confined_path(self.folder, relative, what)

    @property
    def step_package_path(self) -> Path:
        return self.path(self.step_package, "step_package")

    @property
    def layer_chunk_paths(self) -> tuple[Path, ...]:
        """Each layer chunk's package (one path per chunk, so a package serving several repeats)."""
        return tuple(self.path(chunk.package, "layer_chunks.package") for chunk in self.layer_chunks)

    @property
    def weights_path(self) -> Path:
        return self.path(self.weights, "weights")

    @property
    def tokenizer_path(self) -> Path:
        return self.path(self.tokenizer_folder, "tokenizer.folder")

    @property
    def kernels_path(self) -> Path | None:
        return None if self.kernels is None else self.path(self.kernels.path, "kernels.path")

    @property
    def kv_pool_bytes(self) -> int:
        return self.limits.num_kv_blocks * kv_bytes_per_block(self.spec, self.limits.block_size, self.kv_dtype)

    def covers(self, *, max_batch_size: int, max_num_tokens: int, max_seq_len: int) -> bool:
        """Whether the baked limits are at least these: an engine serves any smaller request."""
        limits = self.limits
        return (
            limits.max_batch_size >= max_batch_size
            and limits.max_num_tokens >= max_num_tokens
            and limits.max_seq_len >= max_seq_len
        )

    def rebuild_command(self, **overrides: int) -> str:
        """The `ifb build` command that rebuilds this engine with every option it was built with,
        `overrides` (build option names, e.g. max_batch_size=32) applied."""
        options = replace(self.build_options, **overrides)  # type: ignore[arg-type]
        words = ["ifb", "build"] + ([self.source.path] if self.source.kind != "default" else [])
        for name, value in _asdict(options).items():  # each record field is the `ifb build` flag of its name
            words += ["--" + name.replace("_", "-"), str(value)]
        words += ["-o", str(self.folder)]
        return shlex.join(words)

    # -- engine.json ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        record = {
            "format_version": ENGINE_FORMAT_VERSION,
            "build_id": self.build_id,
            "builder_version": self.builder_version,
            "model_name": self.model_name,
            "model": self.spec.to_json(),
            "limits": self.limits.to_json(),
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "backend": self.backend.value,
            "kv_pool": {
                "shape": list(kv_pool_shape(self.spec, self.limits, self.kv_dtype)),
                "dtype": self.kv_dtype,
                "tokens": self.limits.kv_pool_tokens,
                "bytes": self.kv_pool_bytes,
            },
            "rope_scaling": self.rope_scaling,
            "step_package": self.step_package,
            "weights": self.weights,
            "tokenizer": {"folder": self.tokenizer_folder, "has_chat_template": self.has_chat_template},
            "source": _asdict(self.source),
            "build_options": _asdict(self.build_options),
            "build": self.build_info,
            "tensorrt": None if self.tensorrt is None else _asdict(self.tensorrt),
            "kernels": None if self.kernels is None else _asdict(self.kernels),
            "weight_formats": {name: fmt.value for name, fmt in self.weight_formats.items()},
            "weight_compute": self.weight_compute.value,
            "step_constants_external": self.step_constants_external,
            "cost_model": None if self.cost_model is None else self.cost_model.to_json(),
            "layer_chunks": [_asdict(chunk) for chunk in self.layer_chunks],
            "artifacts": self.artifacts,
        }
        return {**record, RECORD_SHA256: record_sha256(record)}

    @classmethod
    def from_json(cls, record: dict[str, Any], folder: Path) -> EngineConfig:
        where = folder / ENGINE_JSON
        version = record.get("format_version")
        if version != ENGINE_FORMAT_VERSION:
            raise EngineFormatError(
                f"format_version {version} of {where} is not supported (this ifb reads version "
                f"{ENGINE_FORMAT_VERSION}); rebuild the engine with `ifb build`"
            )

        def required(key: str) -> Any:
            if key not in record:
                raise EngineFormatError(f"{where}: missing field {key!r}")
            return record[key]

        try:
            kernels = record.get("kernels")
            tensorrt = record.get("tensorrt")
            cost_model = record.get("cost_model")
            dtype = required("dtype")
            spec = ModelSpec.from_json(required("model"))
            return cls(
                model_name=required("model_name"),
                spec=spec,
                limits=EngineLimits(**required("limits")),
                dtype=dtype,
                kv_dtype=_one_of("kv_dtype", record.get("kv_dtype") or dtype, KV_DTYPES),
                backend=BackendKind(required("backend")),
                rope_scaling=float(required("rope_scaling")),
                step_package=required("step_package"),
                weights=required("weights"),
                tokenizer_folder=required("tokenizer")["folder"],
                has_chat_template=bool(required("tokenizer").get("has_chat_template")),
                source=EngineSource(**required("source")),
                build_id=required("build_id"),
                builder_version=required("builder_version"),
                build_options=BuildOptionsRecord(**required("build_options")),
                build_info=record.get("build") or {},
                tensorrt=None if tensorrt is None else TensorRTPlanInfo(**tensorrt),
                kernels=None if kernels is None else _kernel_info(kernels),
                weight_formats=_weight_formats(record.get("weight_formats") or {}),
                weight_compute=WeightCompute(
                    _one_of("weight_compute", record.get("weight_compute") or "fp32", WEIGHT_COMPUTE_MODES)
                ),
                step_constants_external=bool(record.get("step_constants_external")),
                cost_model=None if cost_model is None else StepCostModel.from_json(cost_model),
                layer_chunks=_layer_chunks(record.get("layer_chunks") or [], spec.num_layers),
                artifacts=required("artifacts"),
                folder=folder,
            )
        except (TypeError, ValueError, KeyError) as error:
            raise EngineFormatError(f"{where}: malformed engine record: {error}") from error

    def write(self, folder: Path) -> None:
        (folder / ENGINE_JSON).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path, verify: bool = True) -> EngineConfig:
        """Read and check engine.json; with `verify`, its seal and every artifact's sha256 are checked."""
        folder = Path(folder).resolve()
        path = folder / ENGINE_JSON
        if not path.is_file():
            raise EngineFormatError(f"{folder} is not an engine folder: {ENGINE_JSON} is missing")
        record = _read_record(path)
        config = cls.from_json(record, folder)
        # Every path is confined to the folder before anything is read through it.
        _ = (config.step_package_path, config.weights_path, config.tokenizer_path, config.kernels_path)
        _ = config.layer_chunk_paths
        if verify:
            verify_record(record, path)
            verify_artifacts(folder, config.artifacts)
        return config


def _read_record(path: Path) -> dict[str, Any]:
    """engine.json as a dict; a file that cannot be read, is not UTF-8 or is not a JSON object is
    refused naming it (json.loads of bytes takes only UTF-8 here: the builder writes nothing else)."""
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as error:
        raise EngineFormatError(f"{path} cannot be read: {error.strerror}") from error
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError alike
        raise EngineFormatError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(record, dict):
        raise EngineFormatError(f"{path} is not a JSON object")
    return record


def _asdict(value: Any) -> dict[str, Any]:
    return {name: (list(v) if isinstance(v, tuple) else v) for name in value.__slots__ for v in [getattr(value, name)]}


def _kernel_info(data: dict[str, Any]) -> KernelLibraryInfo:
    return KernelLibraryInfo(**{**data, "cpu_features": tuple(data["cpu_features"])})


def _layer_chunks(data: list[dict[str, Any]], num_layers: int) -> tuple[LayerChunk, ...]:
    """The chunks as stored: they must run every layer once, in order, or none (an unrolled step)."""
    chunks = tuple(LayerChunk(**item) for item in data)
    starts = [chunk.first_layer for chunk in chunks]
    expected = [sum(chunk.num_layers for chunk in chunks[:index]) for index in range(len(chunks))]
    covered = sum(chunk.num_layers for chunk in chunks)
    if chunks and (starts != expected or covered != num_layers or min(c.num_layers for c in chunks) < 1):
        raise ValueError(f"layer_chunks {data} do not run the model's {num_layers} layers once each, in order")
    return chunks


def _weight_formats(data: dict[str, Any]) -> dict[str, WeightFormat]:
    bad = {name: fmt for name, fmt in data.items() if fmt not in STORED_WEIGHT_FORMATS}
    if bad:
        raise ValueError(f"weight_formats {bad} not in {', '.join(STORED_WEIGHT_FORMATS)}")
    return {name: WeightFormat(fmt) for name, fmt in data.items()}


def _one_of(name: str, value: str, allowed: Collection[str]) -> str:
    """`value` of field `name`, refused (naming the allowed values) unless it is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} {value!r} not in {', '.join(allowed)}")
    return value
