"""How much memory a router model needs (--models-memory): its engine's weights file, step package
and KV pool as engine.json states them plus a stated overhead, or before it is built an estimate
from its source's files. The pool (runtime/server/model_pool.py) is handed these as callables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ifb.runtime.engine_format import ENGINE_JSON
from ifb.runtime.engine_format.config import EngineConfig
from ifb.runtime.server.model_memory import OVERHEAD_BYTES, MemoryNeed, gb_text


def engine_need(config: EngineConfig) -> MemoryNeed:
    """An engine's need: its weights file and step packages (a dense engine's step package holds
    its prepacked weights; a layer-chunked one's are loaded once per chunk) as stored, its KV pool
    as engine.json states it, plus OVERHEAD_BYTES."""
    packages = (config.step_package_path, *config.layer_chunk_paths)
    weights = config.weights_path.stat().st_size + sum(path.stat().st_size for path in packages)
    kv = config.kv_pool_bytes
    detail = f"weights {gb_text(weights)} + KV pool {gb_text(kv)} + overhead {gb_text(OVERHEAD_BYTES)} (engine.json)"
    return MemoryNeed(weights + kv + OVERHEAD_BYTES, detail)


def loaded_need(engine: Any) -> MemoryNeed:
    """A loaded model's need, from the engine.json its client read (LLM.engine_config)."""
    return engine_need(engine.engine_config)


def target_need(target: str) -> MemoryNeed:
    """A TARGET's need before it loads: exact for an engine folder; for a GGUF file or a checkpoint
    folder not built yet, estimated as its files' size plus OVERHEAD_BYTES (the KV pool is not known
    until the build: the measured need replaces the estimate once the model has loaded)."""
    path = Path(target)
    if (path / ENGINE_JSON).is_file():
        return engine_need(EngineConfig.load(path, verify=False))
    if path.is_file():
        size = path.stat().st_size
    elif path.is_dir():
        size = sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))
    else:
        size = 0  # a hub id: nothing here to size until it is fetched and built
    detail = (
        f"estimated: source files {gb_text(size)} + overhead {gb_text(OVERHEAD_BYTES)}, KV pool unknown until built"
    )
    return MemoryNeed(size + OVERHEAD_BYTES, detail, estimated=True)
