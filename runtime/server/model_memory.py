"""What a model of the router holds in memory (--models-memory) as the pool sees it, and which idle
models to unload so that another one fits. How a need is measured (engine.json, or a source's file
size before it is built) is cli/model_needs.py's: the server reads no engine file itself."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

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
    what = ", ".join(f"{h.name} {gb_text(h.bytes)} ({'idle' if h.idle else 'busy'})" for h in held) or "nothing"
    why = "alone" if need.bytes > budget else "even after unloading every idle model"
    raise NoMemoryError(
        f"cannot load model {name!r}: it needs {gb_text(need.bytes)} ({need.detail}), which does not fit "
        f"--models-memory (models_memory_gb) {budget / GB:g} GB {why}; held: {what}"
        + ("" if need.bytes > budget else "; retry when a busy model finishes")
    )


def gb_text(num_bytes: int) -> str:
    return f"{num_bytes / GB:.3f} GB"
