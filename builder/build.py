"""`ifb build`: load a source, convert it to our network, compile it, write the engine folder."""

from __future__ import annotations

import logging
import platform
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ifb.builder.backends import Backend, compiler_for
from ifb.builder.calibrate import calibrate_engine_folder
from ifb.builder.convert import hf_to_network_state_dict
from ifb.builder.engine_writer import atomic_engine_folder, write_engine_json
from ifb.builder.errors import BuildError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.limits import KV_DTYPE_CHOICES, check_kv_dtype_option, resolve_kv_dtype, resolve_limits
from ifb.builder.quant_weights import (
    COMPUTE_CHOICES,
    WEIGHT_CHOICES,
    PackedWeights,
    apply_packed_weights,
    check_compute_option,
    check_weights_option,
    pack_weights,
    packed_dtype,
    source_packs_weights,
)
from ifb.builder.sources import LoadedModel, ModelSource, load_model, resolve_source, source_sha256
from ifb.runtime.engine_format import (
    BuildOptionsRecord,
    EngineConfig,
    EngineLimits,
    EngineSource,
    kv_pool_shape,
)
from ifb.runtime.step.network import StepNetwork, attention_ops

logger = logging.getLogger(__name__)

BUILDER_VERSION = "0.1.0"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
BUILD_STAGES = ("load", "convert", "compile", "write")
__all__ = [
    "COMPUTE_CHOICES",
    "KV_DTYPE_CHOICES",
    "WEIGHT_CHOICES",
    "BuildOptions",
    "BuildSummary",
    "build_dtype",
    "build_engine",
    "build_kv_dtype",
]


@dataclass(frozen=True, slots=True)
class BuildOptions:
    max_batch_size: int = 16
    max_num_tokens: int = 512
    max_seq_len: int = 2048
    block_size: int = 16
    dtype: str = "auto"
    weights: str = "auto"
    kv_dtype: str = "auto"  # the KV pool's dtype; auto = dtype
    compute: str = "fp32"  # how block-quantized layers multiply (WeightCompute)
    kv_blocks: int | None = None
    kv_memory_gb: float | None = None
    backend: Backend = Backend.CPU


@dataclass(frozen=True, slots=True)
class BuildSummary:
    output: Path
    model_name: str
    limits: EngineLimits
    dtype: str
    kv_dtype: str
    kv_pool_bytes: int
    artifact_bytes: int
    seconds: float
    stage_seconds: dict[str, float]


def rope_tables(hf_config: Any) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling from transformers' own RoPE init (llama3/yarn/... scaling)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf_config)
    return rotary.inv_freq.float().clone(), float(rotary.attention_scaling)


def _convert(
    loaded: LoadedModel, limits: EngineLimits, dtype: str, options: BuildOptions
) -> tuple[StepNetwork, torch.Tensor, float]:
    spec = model_spec_from_hf_config(loaded.hf_config)
    inv_freq, rope_scaling = rope_tables(loaded.hf_config)
    state = hf_to_network_state_dict(loaded.state_dict, spec)
    packed: PackedWeights = pack_weights(loaded.source, spec, state, options.weights, options.backend)
    compute = check_compute_option(options.compute, packed)
    network = StepNetwork(
        spec,
        inv_freq,
        rope_scaling,
        limits.max_seq_len,
        limits.block_size,
        # block weights bring the engine's kernel library (builder/backends.py), decode attention with it
        ops=attention_ops(spec, reference=False, has_kernel_library=bool(packed.blocks)),
        weight_formats=packed.formats,
        weight_compute=compute.value,
    )
    state = apply_packed_weights(state, packed, spec, compute)
    missing, unexpected = network.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise BuildError(f"weights do not match the network: missing {missing}, unexpected {unexpected}")
    return network.to(getattr(torch, dtype)).eval(), inv_freq, rope_scaling


def save_weights(network: StepNetwork, inv_freq: torch.Tensor, path: Path) -> None:
    state = {k: v.contiguous() for k, v in network.state_dict().items()}
    if network.spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as embed.weight (absent if the head is packed)
    state["rope.inv_freq"] = inv_freq
    save_file(state, str(path))


def build_dtype(options: BuildOptions, source: ModelSource | None = None) -> str:
    """The dtype `options` builds with on this machine (resolving `auto` per backend, and to
    float32 where `source` will have block-quantized weights: they compute with fp32 activations)."""
    check_weights_option(options.weights, options.backend)
    dtype = compiler_for(options.backend).resolve_dtype(options.dtype)
    packs = options.weights != "fp32" and options.weights != "auto"
    if source is not None:
        packs = source_packs_weights(source, options.weights, options.backend)
    return packed_dtype(options.dtype, dtype, options.weights) if packs else dtype


def build_kv_dtype(options: BuildOptions, dtype: str) -> str:
    """The KV pool's dtype for an engine computing in `dtype` (the result of `build_dtype`)."""
    check_kv_dtype_option(options.kv_dtype, options.backend)
    return resolve_kv_dtype(options.kv_dtype, dtype)


def build_engine(
    source: str | Path | None,
    output: Path,
    options: BuildOptions,
    on_stage: Callable[[str], None] = lambda stage: None,
) -> BuildSummary:
    """Build an engine folder at `output` (atomically); see design.md §3."""
    compiler = compiler_for(options.backend)
    check_kv_dtype_option(options.kv_dtype, options.backend)  # first: refuse an unusable option pair
    build_dtype(options)  # before any work (and before the tensorrt backend looks for a GPU)
    started = time.perf_counter()
    stages: dict[str, float] = {}

    def stage(name: str, begin: float) -> float:
        stages[name] = round(time.perf_counter() - begin, 2)
        return time.perf_counter()

    on_stage("load")
    t = time.perf_counter()
    model_source = resolve_source(source)
    dtype = build_dtype(options, model_source)
    kv_dtype = build_kv_dtype(options, dtype)
    loaded = load_model(model_source)
    spec = model_spec_from_hf_config(loaded.hf_config)
    limits = resolve_limits(
        spec,
        max_batch_size=options.max_batch_size,
        max_num_tokens=options.max_num_tokens,
        max_seq_len=options.max_seq_len,
        block_size=options.block_size,
        kv_dtype=kv_dtype,
        kv_blocks=options.kv_blocks,
        kv_memory_gb=options.kv_memory_gb,
    )
    t = stage("load", t)
    on_stage("convert")
    network, inv_freq, rope_scaling = _convert(loaded, limits, dtype, options)
    t = stage("convert", t)
    with atomic_engine_folder(output) as folder:
        on_stage("compile")
        # The export's sample pools carry the pool dtype into the compiled step's input signature.
        kv_cache = torch.zeros(kv_pool_shape(spec, limits), dtype=getattr(torch, kv_dtype))
        compiled = compiler.compile(network, limits, kv_cache, folder)
        del kv_cache
        t = stage("compile", t)
        on_stage("write")
        save_weights(network, inv_freq, folder / WEIGHTS_FILE)
        loaded.tokenizer.save_pretrained(str(folder / TOKENIZER_DIR))
        stage("write", t)
        config = EngineConfig(
            model_name=model_source.name,
            spec=spec,
            limits=limits,
            dtype=dtype,
            kv_dtype=kv_dtype,
            backend=options.backend,
            rope_scaling=rope_scaling,
            step_package=compiled.step_package,
            weights=WEIGHTS_FILE,
            tokenizer_folder=TOKENIZER_DIR,
            has_chat_template=bool(getattr(loaded.tokenizer, "chat_template", None)),
            source=_engine_source(model_source),
            build_id=uuid.uuid4().hex,
            builder_version=BUILDER_VERSION,
            build_options=_options_record(options, limits, dtype, kv_dtype),
            build_info=_build_info(started, stages),
            tensorrt=compiled.tensorrt,
            kernels=compiled.kernels,
            weight_formats=network.weight_formats,
            weight_compute=network.weight_compute.value,
        )
        write_engine_json(folder, config)
        t = time.perf_counter()
        # Last, on the finished folder: it times the engine exactly as `ifb run` will load it.
        calibrate_engine_folder(folder)
        stage("calibrate", t)
        artifact_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return BuildSummary(
        output=output,
        model_name=model_source.name,
        limits=limits,
        dtype=dtype,
        kv_dtype=kv_dtype,
        kv_pool_bytes=config.kv_pool_bytes,
        artifact_bytes=artifact_bytes,
        seconds=time.perf_counter() - started,
        stage_seconds=stages,
    )


def _engine_source(source: ModelSource) -> EngineSource:
    return EngineSource(kind=source.kind.value, path=str(source.path), sha256=source_sha256(source))


def _options_record(options: BuildOptions, limits: EngineLimits, dtype: str, kv_dtype: str) -> BuildOptionsRecord:
    return BuildOptionsRecord(
        max_batch_size=limits.max_batch_size,
        max_num_tokens=limits.max_num_tokens,
        max_seq_len=limits.max_seq_len,
        block_size=limits.block_size,
        kv_blocks=limits.num_kv_blocks,
        dtype=dtype,
        backend=options.backend.value,
        weights=options.weights,
        # auto when it is the engine's dtype, so a rebuild with another --dtype keeps the two equal
        kv_dtype="auto" if kv_dtype == dtype else kv_dtype,
        compute=options.compute,
    )


def _build_info(started: float, stages: dict[str, float]) -> dict[str, Any]:
    return {
        "seconds": round(time.perf_counter() - started, 2),
        "stage_seconds": stages,
        "torch_version": torch.__version__,
        "machine": platform.machine(),
        "created_unix": int(time.time()),
    }
