"""`ifb build`: load a source, convert it to our network, compile it, write the engine folder."""

from __future__ import annotations

import logging
import platform
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ifb.builder.backends import Backend, compiler_for
from ifb.builder.build_clock import BuildClock
from ifb.builder.calibrate import calibrate_engine_folder
from ifb.builder.compile_process import (
    CompileProcess,
    compile_in_child_process,
    refuse_in_spawned_bootstrap,
    started_compile_process,
)
from ifb.builder.compiled_step import CompiledStep
from ifb.builder.engine_writer import atomic_engine_folder, write_engine_json
from ifb.builder.errors import BuildError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.layer_chunk_plan import LayerChunking
from ifb.builder.limits import KV_DTYPE_CHOICES, check_kv_dtype_option, resolve_kv_dtype, resolve_limits
from ifb.builder.network_recipe import INV_FREQ, NetworkRecipe
from ifb.builder.quant_weights import (
    COMPUTE_CHOICES,
    WEIGHT_CHOICES,
    check_weights_option,
    packed_dtype,
    resolve_compute,
    source_packs_weights,
)
from ifb.builder.rope import rope_tables
from ifb.builder.sources import (
    ModelSource,
    SourceMetadata,
    load_metadata,
    open_tensors,
    resolve_source,
    source_sha256,
)
from ifb.builder.weight_loader import PackedTiles, network_state, plan_weights, warn_dequantized
from ifb.runtime.engine_format import (
    DTYPE_ALIASES,
    BuildOptionsRecord,
    EngineConfig,
    EngineLimits,
    EngineSource,
)
from ifb.runtime.engine_format.weights_file import TensorEntry, WeightsWriter
from ifb.runtime.runtime_config import option
from ifb.runtime.step.network import StepNetwork

logger = logging.getLogger(__name__)

BUILDER_VERSION = "0.1.0"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
BUILD_STAGES = ("read", "pack", "compile", "write", "calibrate")
CALIBRATION_CHOICES = ("auto", "build", "serve")
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
    """What `ifb build` (and `ifb run SOURCE`, `LLM(SOURCE)`) is asked to build; each field is the
    `ifb build` flag of the same name, with its help (runtime_config.option)."""

    max_batch_size: int = option(16, "Seats per step baked into the engine.")
    max_num_tokens: int = option(512, "Tokens per step baked into the engine.")
    max_seq_len: int = option(2048, "Longest prompt + output in tokens.")
    block_size: int = option(16, "Tokens per KV block (a power of two).")
    dtype: str = option(
        "auto",
        "Activation/KV dtype (vLLM and TensorRT-LLM spellings: float32/fp32, bfloat16/bf16, float16/fp16). "
        "auto: cpu backend: bf16 where the CPU has bf16 matrix units (AMX/AVX512-BF16), else fp32; "
        "tensorrt backend: bf16 on compute capability >= 8.0, else fp16. fp16 is tensorrt only.",
        choices=("auto", *DTYPE_ALIASES),
        case_sensitive=False,
    )
    weights: str = option(
        "auto",
        "How linear weights are stored: auto keeps the source's precision (a GGUF's Q4_0/Q4_1/Q8_0 blocks, "
        "an HF checkpoint's floats); fp32 dequantizes everything; q8_0/q4_1/q4_0 quantize every linear layer "
        "(round-to-nearest per 32-weight block). Block formats make an fp32 engine; --compute says how they "
        "multiply (cpu backend only).",
        choices=WEIGHT_CHOICES,
    )
    kv_dtype: str = option(  # the KV pool's dtype; auto = dtype
        "auto",
        "What the paged KV cache stores: auto = the engine's dtype; float16/fp16/half (or bfloat16/bf16) "
        "halves the pool of an fp32 engine, so --kv-memory holds twice the blocks; q8_0 stores int8 with an fp16 "
        "scale per 32 values (llama.cpp's Q8_0), about half of fp16's bytes. The step still computes in "
        "its dtype: K/V are rounded when written and read back in fp32 (cpu backend only).",
        choices=KV_DTYPE_CHOICES,
        case_sensitive=False,
    )
    compute: str = option(  # how block-quantized layers multiply: auto, or a WeightCompute value
        "auto",
        "How block-quantized layers multiply: auto = int8 where the engine keeps block weights and this CPU "
        "has integer dot products that pay (AVX2, AVX-512, VNNI: all measured faster), else fp32; int8 = "
        "activations quantized per row and 32-block to int8 and integer dot products, as llama.cpp multiplies "
        "its blocks (~2.7x faster layers at 32 rows; quality cost in bench/README.md); fp32 = fp32 activations "
        "times the exact weights (the fp32 engine's numbers up to summation order). Rows stay batch-invariant "
        "either way.",
        choices=COMPUTE_CHOICES,
    )
    kv_blocks: int | None = option(None, "KV pool size in blocks.")
    kv_memory_gb: float | None = option(None, "KV pool size in GB (instead of --kv-blocks).", flag="--kv-memory")
    backend: Backend = option(Backend.CPU, "What compiles and runs the step.")
    cache: bool = option(
        True,
        "Reuse what this machine already made for an engine of the same shapes, formats, limits, ISA and "
        "versions: the step cost model (step_budget/cost_model_cache.py) instead of timing the engine again, and a "
        "block engine's compiled kernels and step (builder/artifact_cache.py) instead of compiling them again; "
        "--no-cache times and compiles anew (and stores the results).",
    )
    calibration: str = option(
        "auto",
        "When the step cost model is timed if this machine stored none for the engine's shape: build = as the "
        "build's last phase, into engine.json; serve = not in the build: the server starts at once with a "
        "conservative step budget, times the engine in its idle turns and stores the fit; auto = build for "
        "`ifb build`, serve for `ifb run SOURCE` and LLM(SOURCE) (their first token does not wait for it).",
        choices=CALIBRATION_CHOICES,
    )
    layer_chunks: str = option(
        "auto",
        "A block engine's step as chunks of alike decoder layers, one compiled package run once per chunk, "
        "instead of one graph of every layer: its compile does not grow with depth, and a chunked step "
        "decodes one row 2-6% slower (builder/layer_chunk_plan.py). auto = where it cuts the compile by a "
        "third (deep models), a chunk per 128 MiB of layers at most; on = wherever the layers repeat; "
        "off = never.",
        choices=tuple(mode.value for mode in LayerChunking),
    )

    def __post_init__(self) -> None:  # accept the backend's string value from CLIs and callers
        object.__setattr__(self, "backend", Backend(self.backend))


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
    stage_peak_bytes: dict[str, int]  # each phase's own peak resident memory (build_clock.py)
    weight_compute: str
    cost_model: str = "none"  # engine.json's build.cost_model: measured, reused, pending (timed when serving), none


def _convert(
    metadata: SourceMetadata, limits: EngineLimits, dtype: str, options: BuildOptions, weights_path: Path
) -> NetworkRecipe:
    """Write the network's weights to `weights_path` module by module from the mapped source (the
    build holds one module in flight, never a second whole copy) and return the recipe that
    rebuilds the network over them."""
    spec = model_spec_from_hf_config(metadata.hf_config)
    inv_freq, rope_scaling = rope_tables(metadata.hf_config, limits.max_seq_len)
    tensors = open_tensors(metadata.source, spec)
    keeps_blocks = source_packs_weights(metadata.source, options.weights, options.backend)
    plan = plan_weights(tensors, options.weights if keeps_blocks or options.weights != "auto" else "fp32")
    compute = resolve_compute(options.compute, plan.has_blocks)
    warn_dequantized(plan, torch.finfo(getattr(torch, dtype)).bits // 8)
    recipe = NetworkRecipe(spec, inv_freq, rope_scaling, limits.max_seq_len, limits.block_size, plan.formats, compute)
    network = recipe.empty_network()
    writer = WeightsWriter(weights_path, stored_entries(network, getattr(torch, dtype), inv_freq))
    for name, value in network_state(tensors, plan, compute):
        if isinstance(value, PackedTiles):
            value.write_into(writer, name)
        else:
            writer.write(name, value)
    writer.write(INV_FREQ, inv_freq)
    try:
        writer.close()
        recipe.load(weights_path)  # every stored tensor is where the network expects it
    except ValueError as error:
        raise BuildError(str(error)) from error
    return recipe


def stored_entries(network: StepNetwork, dtype: torch.dtype, inv_freq: torch.Tensor) -> dict[str, TensorEntry]:
    """What the weights file holds: the network's state (floating tensors in the engine's dtype; a
    tied dense head once, as the embedding) and the rotary inv_freq in fp32."""
    entries: dict[str, TensorEntry] = {}
    for name, tensor in network.state_dict().items():
        if name == "lm_head.weight" and network.spec.tie_word_embeddings:
            continue  # the same tensor as embed.weight
        stored = dtype if tensor.is_floating_point() else tensor.dtype
        entries[name] = TensorEntry(stored, tuple(tensor.shape))
    entries[INV_FREQ] = TensorEntry(torch.float32, tuple(inv_freq.shape))
    return entries


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
    """Build an engine folder at `output` (atomically); see docs/design.md §5.4."""
    refuse_in_spawned_bootstrap()
    check_kv_dtype_option(options.kv_dtype, options.backend)  # first: refuse an unusable option pair
    build_dtype(options)  # before any work (and before the tensorrt backend looks for a GPU)
    # started first: its imports run on the other core while this process reads and packs the file
    with started_compile_process() as compile_process:
        return _build_engine(source, output, options, on_stage, compile_process)


def _build_engine(
    source: str | Path | None,
    output: Path,
    options: BuildOptions,
    on_stage: Callable[[str], None],
    compile_process: CompileProcess | None,
) -> BuildSummary:
    clock = BuildClock()

    def phase(name: str) -> None:
        on_stage(name)
        clock.start(name)

    phase("read")
    model_source = resolve_source(source)
    dtype = build_dtype(options, model_source)
    kv_dtype = build_kv_dtype(options, dtype)
    metadata = load_metadata(model_source)
    spec = model_spec_from_hf_config(metadata.hf_config)
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
    with atomic_engine_folder(output) as folder:
        phase("pack")
        recipe = _convert(metadata, limits, dtype, options, folder / WEIGHTS_FILE)
        phase("compile")
        compiled, compile_peak = compile_in_child_process(
            options.backend,
            recipe,
            folder / WEIGHTS_FILE,
            limits,
            kv_dtype,
            folder,
            reuse=options.cache,
            process=compile_process,
            chunking=LayerChunking(options.layer_chunks),
        )
        clock.count_child(compile_peak)
        phase("write")
        metadata.tokenizer.save_pretrained(str(folder / TOKENIZER_DIR))
        clock.stop()
        config = EngineConfig(
            model_name=model_source.name,
            spec=spec,
            limits=limits,
            dtype=dtype,
            kv_dtype=kv_dtype,
            backend=options.backend,
            rope_scaling=recipe.rope_scaling,
            step_package=compiled.step_package,
            weights=WEIGHTS_FILE,
            tokenizer_folder=TOKENIZER_DIR,
            has_chat_template=bool(getattr(metadata.tokenizer, "chat_template", None)),
            source=_engine_source(model_source),
            build_id=uuid.uuid4().hex,
            builder_version=BUILDER_VERSION,
            build_options=_options_record(options, limits, dtype, kv_dtype),
            build_info=_build_info(clock, compiled),
            tensorrt=compiled.tensorrt,
            kernels=compiled.kernels,
            weight_formats=dict(recipe.weight_formats),
            weight_compute=recipe.weight_compute,
            step_constants_external=compiled.constants_external,
            layer_chunks=compiled.layer_chunks,
        )
        write_engine_json(folder, config)
        # Last, on the finished folder: it times the engine exactly as `ifb run` will load it.
        phase("calibrate")

        def measured_build_info() -> dict[str, Any]:
            clock.stop()
            return _build_info(clock, compiled)

        # records the calibration's time and peak too; `serve` leaves a shape never timed here to the server
        defer = options.calibration == "serve"
        calibrate_engine_folder(folder, measured_build_info, reuse=options.cache, defer=defer)
        cost_model = EngineConfig.load(folder, verify=False).build_info.get("cost_model", "none")
        artifact_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return BuildSummary(
        output=output,
        model_name=model_source.name,
        limits=limits,
        dtype=dtype,
        kv_dtype=kv_dtype,
        kv_pool_bytes=config.kv_pool_bytes,
        artifact_bytes=artifact_bytes,
        seconds=time.perf_counter() - clock.started,
        stage_seconds=clock.seconds,
        stage_peak_bytes=clock.peak_bytes,
        weight_compute=config.weight_compute.value,
        cost_model=cost_model,
    )


def _engine_source(source: ModelSource) -> EngineSource:
    return EngineSource(kind=source.kind.value, path=str(source.path), sha256=source_sha256(source))


def _options_record(options: BuildOptions, limits: EngineLimits, dtype: str, kv_dtype: str) -> BuildOptionsRecord:
    """`options` as built: each record field from the option of its name, the limits' value where
    `limits` has one (as resolved), and what the build resolved from auto."""
    record = {f.name: getattr(options, f.name) for f in fields(BuildOptionsRecord)}
    record.update((name, getattr(limits, name)) for name in list(record) if hasattr(limits, name))
    return BuildOptionsRecord(
        **{
            **record,
            "kv_blocks": limits.num_kv_blocks,  # sized from --kv-memory or the seats when not given
            "dtype": dtype,
            "backend": options.backend.value,
            # auto when it is the engine's dtype, so a rebuild with another --dtype keeps the two equal
            "kv_dtype": "auto" if kv_dtype == dtype else kv_dtype,
        }
    )


def _build_info(clock: BuildClock, compiled: CompiledStep) -> dict[str, Any]:
    return {
        # what the compile phase copied from this machine's compile cache (builder/artifact_cache.py)
        "compile_cache_reused": list(compiled.reused),
        "seconds": round(time.perf_counter() - clock.started, 2),
        "stage_seconds": dict(clock.seconds),
        "stage_peak_rss_mb": {name: round(value / 2**20) for name, value in clock.peak_bytes.items()},
        "torch_version": torch.__version__,
        "machine": platform.machine(),
        "created_unix": int(time.time()),
    }
