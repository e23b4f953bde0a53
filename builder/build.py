"""`ifb build`: load a source, convert it to our network, compile it, write the engine folder."""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ifb.builder.backends import Backend, compiler_for
from ifb.builder.engine_writer import atomic_engine_folder, write_engine_json
from ifb.builder.errors import BuildError
from ifb.builder.limits import (
    EngineLimits,
    kv_bytes_per_block,
    kv_pool_shape,
    resolve_limits,
)
from ifb.builder.model_spec import model_spec_from_hf_config
from ifb.builder.network import StepNetwork, hf_to_network_state_dict
from ifb.builder.sources import LoadedModel, load_model, resolve_source, source_sha256

logger = logging.getLogger(__name__)

BUILDER_VERSION = "0.1.0"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"
BUILD_STAGES = ("load", "convert", "compile", "write")


@dataclass(frozen=True, slots=True)
class BuildOptions:
    max_batch_size: int = 16
    max_num_tokens: int = 512
    max_seq_len: int = 2048
    block_size: int = 16
    dtype: str = "auto"
    kv_blocks: int | None = None
    kv_memory_gb: float | None = None
    backend: Backend = Backend.CPU


@dataclass(frozen=True, slots=True)
class BuildSummary:
    output: Path
    model_name: str
    limits: EngineLimits
    dtype: str
    kv_pool_bytes: int
    artifact_bytes: int
    seconds: float
    stage_seconds: dict[str, float]


def rope_tables(hf_config: Any) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling from transformers' own RoPE init (llama3/yarn/... scaling)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf_config)
    return rotary.inv_freq.float().clone(), float(rotary.attention_scaling)


def _convert(loaded: LoadedModel, limits: EngineLimits, dtype: str) -> tuple[StepNetwork, torch.Tensor, float]:
    spec = model_spec_from_hf_config(loaded.hf_config)
    inv_freq, rope_scaling = rope_tables(loaded.hf_config)
    network = StepNetwork(spec, inv_freq, rope_scaling, limits.max_seq_len, limits.block_size)
    state = hf_to_network_state_dict(loaded.state_dict, spec)
    missing, unexpected = network.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise BuildError(f"weights do not match the network: missing {missing}, unexpected {unexpected}")
    return network.to(getattr(torch, dtype)).eval(), inv_freq, rope_scaling


def save_weights(network: StepNetwork, inv_freq: torch.Tensor, path: Path) -> None:
    state = {k: v.contiguous() for k, v in network.state_dict().items()}
    if network.spec.tie_word_embeddings:
        del state["lm_head.weight"]
    state["rope.inv_freq"] = inv_freq
    save_file(state, str(path))


def build_dtype(options: BuildOptions) -> str:
    """The dtype `options` builds with on this machine (resolving `auto` per backend)."""
    return compiler_for(options.backend).resolve_dtype(options.dtype)


def build_engine(
    source: str | Path | None,
    output: Path,
    options: BuildOptions,
    on_stage: Callable[[str], None] = lambda stage: None,
) -> BuildSummary:
    """Build an engine folder at `output` (atomically); see design.md §3."""
    compiler = compiler_for(options.backend)
    dtype = compiler.resolve_dtype(options.dtype)  # first: refuses an unusable backend before any work
    started = time.perf_counter()
    stages: dict[str, float] = {}

    def stage(name: str, begin: float) -> float:
        stages[name] = round(time.perf_counter() - begin, 2)
        return time.perf_counter()

    on_stage("load")
    t = time.perf_counter()
    model_source = resolve_source(source)
    loaded = load_model(model_source)
    spec = model_spec_from_hf_config(loaded.hf_config)
    limits = resolve_limits(
        spec,
        max_batch_size=options.max_batch_size,
        max_num_tokens=options.max_num_tokens,
        max_seq_len=options.max_seq_len,
        block_size=options.block_size,
        dtype=dtype,
        kv_blocks=options.kv_blocks,
        kv_memory_gb=options.kv_memory_gb,
    )
    t = stage("load", t)
    on_stage("convert")
    network, inv_freq, rope_scaling = _convert(loaded, limits, dtype)
    t = stage("convert", t)
    with atomic_engine_folder(output) as folder:
        on_stage("compile")
        kv_cache = torch.zeros(kv_pool_shape(spec, limits), dtype=getattr(torch, dtype))
        artifact_fields = compiler.compile(network, limits, kv_cache, folder)
        del kv_cache
        t = stage("compile", t)
        on_stage("write")
        save_weights(network, inv_freq, folder / WEIGHTS_FILE)
        loaded.tokenizer.save_pretrained(str(folder / TOKENIZER_DIR))
        kv_pool_bytes = limits.num_kv_blocks * kv_bytes_per_block(spec, limits.block_size, dtype)
        stage("write", t)
        record = {
            "builder_version": BUILDER_VERSION,
            "model_name": model_source.name,
            "model": spec.to_json(),
            "limits": limits.to_json(),
            "dtype": dtype,
            "backend": options.backend.value,
            "kv_pool": {
                "shape": list(kv_pool_shape(spec, limits)),
                "tokens": limits.kv_pool_tokens,
                "bytes": kv_pool_bytes,
            },
            "rope_scaling": rope_scaling,
            **artifact_fields,
            "weights": WEIGHTS_FILE,
            "tokenizer": {
                "folder": TOKENIZER_DIR,
                "has_chat_template": bool(getattr(loaded.tokenizer, "chat_template", None)),
            },
            "source": {
                "kind": model_source.kind.value,
                "path": str(model_source.path),
                "sha256": source_sha256(model_source),
            },
            "build": {
                "seconds": round(time.perf_counter() - started, 2),
                "stage_seconds": stages,
                "torch_version": torch.__version__,
                "machine": platform.machine(),
                "created_unix": int(time.time()),
            },
        }
        write_engine_json(folder, record)
        artifact_bytes = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return BuildSummary(
        output=output,
        model_name=model_source.name,
        limits=limits,
        dtype=dtype,
        kv_pool_bytes=kv_pool_bytes,
        artifact_bytes=artifact_bytes,
        seconds=time.perf_counter() - started,
        stage_seconds=stages,
    )
