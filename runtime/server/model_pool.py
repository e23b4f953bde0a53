"""The router's models: which are loaded, loading one on demand off the event loop, and unloading
the least recently used idle ones (--max-loaded-models, --models-memory) or any idle too long
(--idle-unload-s).

Cores: the loaded models share the process's one torch thread setting (--threads, else the
environment's); the pool does not split the cores between them. Two models stepping at once
each use that many threads, so with busy models at the same time the cores are oversubscribed
by up to the number loaded: --max-loaded-models 1 is the way to rule that out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from ifb.runtime.engine_client import EngineClient
from ifb.runtime.server.model_memory import GB, Held, MemoryNeed, to_unload

logger = logging.getLogger(__name__)


class LoadedModel(EngineClient, Protocol):
    def close(self) -> None:
        """Stop the step loop and free the engine's memory."""
        ...


class ModelState(Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


class NoRoomError(Exception):
    """Loading the model would pass --max-loaded-models and no loaded model is idle (a 503)."""


class ModelLoadError(Exception):
    """Loading the model failed (a 503 naming why)."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the router serves: its name, and how to load it (on a worker thread)."""

    name: str
    load: Callable[[], LoadedModel]
    where: str  # the engine folder or source, for /v1/models and the log
    need: Callable[[], MemoryNeed] | None = None  # before it loads (--models-memory); None: not sized
    loaded_need: Callable[[LoadedModel], MemoryNeed] | None = None  # measured once loaded; None: keep `need`
    # while it loads: the stage of its build, if one runs ({"stage", "stage_for_s"}), else None
    progress: Callable[[], dict[str, Any] | None] | None = None


@dataclass(slots=True)
class _Slot:
    spec: ModelSpec
    state: ModelState = ModelState.UNLOADED
    engine: LoadedModel | None = None
    app: Any = None  # the per-model ASGI app over `engine`
    in_flight: int = 0
    last_used: float = 0.0
    loading: asyncio.Future[None] | None = None
    load_started: float = 0.0
    last_error: str | None = None
    need: MemoryNeed | None = None  # measured once loaded (kept after an unload), else estimated
    closing: list[asyncio.Future[None]] = field(default_factory=list)


class ModelPool:
    def __init__(
        self,
        specs: list[ModelSpec],
        make_app: Callable[[LoadedModel, str], Any],
        max_loaded: int | None = None,
        idle_unload_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        memory_budget: int | None = None,
    ) -> None:
        self.slots = {spec.name: _Slot(spec) for spec in specs}
        self.make_app = make_app
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget  # bytes (--models-memory); None: no bound
        self.idle_unload_s = idle_unload_s
        self.clock = clock
        self._idle_task: asyncio.Task[None] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.slots)

    async def acquire(self, name: str) -> Any:
        """The model's app, loading it first if needed, with one more request counted in flight
        (call `release` when the request is done). Concurrent callers share one load."""
        self.start_idle_unloads()
        slot = self.slots[name]
        while True:
            slot.last_used = self.clock()
            if slot.state is ModelState.LOADED:
                slot.in_flight += 1
                return slot.app
            if slot.loading is None:
                victims = self._make_room(slot)  # NoRoomError: a 503, nothing unloaded
                slot.state, slot.load_started = ModelState.LOADING, self.clock()
                slot.loading = asyncio.ensure_future(self._load(slot, victims))
            await asyncio.shield(slot.loading)  # a caller leaving does not cancel the load
            # Loaded: loop, since an unload may have run between the load's end and now.

    def release(self, name: str) -> None:
        slot = self.slots[name]
        slot.in_flight -= 1
        slot.last_used = self.clock()

    def _make_room(self, wanted: _Slot) -> list[asyncio.Future[None]]:
        """Unload least-recently-used idle models until one more fits both bounds; their closes to
        await. NoRoomError / NoMemoryError (503s) when it cannot, with nothing unloaded."""
        occupied = [s for s in self.slots.values() if s.state is not ModelState.UNLOADED]
        idle = sorted((s for s in occupied if s.state is ModelState.LOADED and s.in_flight == 0), key=_last_used)
        excess = 0 if self.max_loaded is None else max(0, len(occupied) - self.max_loaded + 1)
        if len(idle) < excess:
            busy = ", ".join(f"{s.spec.name} ({s.state.value}, {s.in_flight} in flight)" for s in occupied)
            raise NoRoomError(
                f"cannot load model {wanted.spec.name!r}: --max-loaded-models (max_loaded_models) is "
                f"{self.max_loaded} and no loaded model is idle to unload: {busy}; retry when one finishes"
            )
        victims = idle[:excess]
        if self.memory_budget is not None:
            idle_names = {s.spec.name for s in idle}
            held = [Held(s.spec.name, self._need(s).bytes, s.spec.name in idle_names, s.last_used) for s in occupied]
            names = to_unload(wanted.spec.name, self._need(wanted), held, self.memory_budget, excess)
            victims = [self.slots[name] for name in names]
        return [self.unload(s, "to make room for " + repr(wanted.spec.name)) for s in victims]

    def _need(self, slot: _Slot) -> MemoryNeed:
        if slot.need is None:
            # engine.json or a file's size: a small read, done once per model
            slot.need = slot.spec.need() if slot.spec.need is not None else MemoryNeed(0, "not sized", True)
        return slot.need

    def _trim(self, loaded: _Slot) -> None:
        """Once a model's measured need replaced an estimate that was too low: unload other idle
        models, least recently used first, while the loaded ones pass the budget (a warning when
        busy ones keep it past: the load has already happened)."""
        budget = self.memory_budget
        if budget is None:
            return
        occupied = [s for s in self.slots.values() if s.state is not ModelState.UNLOADED]
        total = sum(self._need(s).bytes for s in occupied)
        for slot in sorted((s for s in occupied if s.state is ModelState.LOADED and s.in_flight == 0), key=_last_used):
            if total <= budget:
                return
            if slot is not loaded:
                self.unload(slot, f"{loaded.spec.name!r} measured larger than its estimate")
                total -= self._need(slot).bytes
        if total > budget:
            logger.warning(
                "models hold %.3f GB, past --models-memory %g GB: %r measured %s",
                total / GB,
                budget / GB,
                loaded.spec.name,
                self._need(loaded).detail,
            )

    async def _load(self, slot: _Slot, victims: list[asyncio.Future[None]]) -> None:
        try:
            # Their memory, and that of models unloading for being idle, is freed before this one takes its own.
            await asyncio.gather(*victims, *(f for s in self.slots.values() for f in s.closing))
            logger.info("loading model %s from %s", slot.spec.name, slot.spec.where)
            engine = await asyncio.to_thread(slot.spec.load)
            try:
                slot.app = self.make_app(engine, slot.spec.name)
            except BaseException:
                await asyncio.to_thread(engine.close)
                raise
            slot.engine, slot.state, slot.last_error = engine, ModelState.LOADED, None
            if slot.spec.loaded_need is not None:
                estimate, slot.need = self._need(slot), slot.spec.loaded_need(engine)
                if slot.need.bytes > estimate.bytes:
                    self._trim(slot)
            logger.info("loaded model %s in %.1f s", slot.spec.name, self.clock() - slot.load_started)
        except Exception as error:
            slot.state, slot.last_error = ModelState.UNLOADED, f"{type(error).__name__}: {error}"
            logger.exception("loading model %s failed", slot.spec.name)
            raise ModelLoadError(f"loading model {slot.spec.name!r} failed: {slot.last_error}") from error
        finally:
            slot.loading = None

    def unload(self, slot: _Slot, why: str) -> asyncio.Future[None]:
        """Mark the model unloaded now and close its engine on a worker thread (its step loop
        stops and its memory goes); the returned future is done when it has."""
        engine, slot.engine, slot.app, slot.state = slot.engine, None, None, ModelState.UNLOADED
        logger.info("unloading model %s (%s)", slot.spec.name, why)
        closed = asyncio.ensure_future(asyncio.to_thread(engine.close) if engine is not None else _nothing())
        slot.closing.append(closed)
        closed.add_done_callback(slot.closing.remove)
        return closed

    def start_idle_unloads(self) -> None:
        if self.idle_unload_s is not None and self._idle_task is None:
            self._idle_task = asyncio.ensure_future(self._unload_idle_forever(self.idle_unload_s))

    async def _unload_idle_forever(self, idle_s: float) -> None:
        period = max(0.05, idle_s / 4)  # so a model goes within idle_s + a quarter of it
        while True:
            await asyncio.sleep(period)
            now = self.clock()
            for slot in self.slots.values():
                if slot.state is ModelState.LOADED and slot.in_flight == 0 and now - slot.last_used >= idle_s:
                    self.unload(slot, f"idle {now - slot.last_used:.1f} s >= --idle-unload-s {idle_s:g}")

    async def close(self) -> None:
        """Stop unloading idle models, and unload every model (at shutdown)."""
        if self._idle_task is not None:
            self._idle_task.cancel()
            self._idle_task = None
        loads = [s.loading for s in self.slots.values() if s.loading is not None]
        await asyncio.gather(*loads, return_exceptions=True)
        closes = [self.unload(s, "shutdown") for s in self.slots.values() if s.state is ModelState.LOADED]
        pending = [f for s in self.slots.values() for f in s.closing]
        await asyncio.gather(*closes, *pending, return_exceptions=True)

    def status(self, name: str) -> dict[str, Any]:
        """A model's state for /v1/models and /health."""
        slot = self.slots[name]
        status: dict[str, Any] = {"state": slot.state.value, "in_flight": slot.in_flight}
        if slot.state is ModelState.LOADING:
            status["loading_for_s"] = round(self.clock() - slot.load_started, 1)
            build = slot.spec.progress() if slot.spec.progress is not None else None
            if build is not None:
                status["build"] = build
        if slot.last_error is not None:
            status["last_error"] = slot.last_error
        if slot.spec.need is not None or slot.need is not None:
            need = self._need(slot)
            status["memory_bytes"], status["memory_estimated"] = need.bytes, need.estimated
            status["memory_detail"] = need.detail
        return status

    def memory(self) -> dict[str, int] | None:
        """--models-memory's budget and what the loaded and loading models hold, in bytes."""
        if self.memory_budget is None:
            return None
        held = sum(self._need(s).bytes for s in self.slots.values() if s.state is not ModelState.UNLOADED)
        return {"budget_bytes": self.memory_budget, "held_bytes": held}


def _last_used(slot: _Slot) -> float:
    return slot.last_used


async def _nothing() -> None:
    return None
