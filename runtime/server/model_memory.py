"""What a model of the router holds in memory (--models-memory): its engine's weight bytes, KV
pool bytes and a stated per-model overhead, read from engine.json, or estimated from the source's
file size before it is built; and which idle models to unload so that another one fits."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ifb.runtime.engine_format import ENGINE_JSON
from ifb.runtime.engine_format.config import EngineConfig

logger = logging.getLogger(__name__)

# Per loaded model beyond weights and KV pool: the step's activation buffers, the tokenizer, the
# executor's and server's Python objects. A stated allowance, not measured per model.
OVERHEAD_BYTES = 256 << 20
GB = 10**9  # --models-memory is in GB (10^9 bytes), as --prefix-cache-disk-gb


@dataclass(frozen=True, slots=True)
class MemoryNeed:
    """Bytes a loaded model holds, and how that figure was made (shown in /health, /v1/models and
    in a refusal). `estimated`: before its engine exists, from the source's size."""

    bytes: int
    detail: str
    estimated: bool = False


def engine_need(config: EngineConfig) -> MemoryNeed:
    """An engine's need: its weights file and step package (a dense engine's step package holds
    its prepacked weights) as stored, its KV pool as engine.json states it, plus OVERHEAD_BYTES."""
    weights = config.weights_path.stat().st_size + config.step_package_path.stat().st_size
    kv = config.kv_pool_bytes
    detail = f"weights {_gb(weights)} + KV pool {_gb(kv)} + overhead {_gb(OVERHEAD_BYTES)} (engine.json)"
    return MemoryNeed(weights + kv + OVERHEAD_BYTES, detail)


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
    detail = f"estimated: source files {_gb(size)} + overhead {_gb(OVERHEAD_BYTES)}, KV pool unknown until built"
    return MemoryNeed(size + OVERHEAD_BYTES, detail, estimated=True)


@dataclass(frozen=True, slots=True)
class Held:
    """A model holding memory (loaded or loading), as the choice of what to unload sees it."""

    name: str
    bytes: int
    idle: bool  # loaded with no request in flight: may be unloaded
    last_used: float


class NoMemoryError(Exception):
    """The model does not fit in --models-memory even after unloading every idle model (a 503)."""


def to_unload(name: str, need: MemoryNeed, held: Sequence[Held], budget: int, at_least: int = 0) -> list[str]:
    """The least recently used idle models to unload, fewest first, so that `need` fits in `budget`
    beside what stays, unloading at least `at_least` of them (--max-loaded-models' count).
    NoMemoryError naming the budget, the need and what is held when no choice fits."""
    idle = sorted((h for h in held if h.idle), key=lambda h: h.last_used)
    total = sum(h.bytes for h in held)
    chosen: list[str] = []
    for victim in idle:
        if len(chosen) >= at_least and total + need.bytes <= budget:
            break
        chosen.append(victim.name)
        total -= victim.bytes
    if total + need.bytes <= budget:
        return chosen
    what = ", ".join(f"{h.name} {_gb(h.bytes)} ({'idle' if h.idle else 'busy'})" for h in held) or "nothing"
    why = "alone" if need.bytes > budget else "even after unloading every idle model"
    raise NoMemoryError(
        f"cannot load model {name!r}: it needs {_gb(need.bytes)} ({need.detail}), which does not fit "
        f"--models-memory (models_memory_gb) {budget / GB:g} GB {why}; held: {what}"
        + ("" if need.bytes > budget else "; retry when a busy model finishes")
    )


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / GB:.3f} GB"
