"""Where a build running in its own process is: its stages forwarded to the serving process.

A model built at its first request (`ifb run --models-dir` with a GGUF not built yet) takes
minutes on a 2-core machine; the router's /health shows which stage it is in (read, pack,
compile, write) and for how long, instead of only how long the model has been loading. The build
runs in a spawned child (find_or_build.build_in_child_process), so its stages cross a queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from multiprocessing.queues import Queue
from typing import Any

logger = logging.getLogger(__name__)

_child_queue: Queue[str | None] | None = None  # set in the build's child process only


def start_child(queue: Queue[str | None]) -> None:
    """The build child's initializer: where report_stage sends its stages."""
    global _child_queue
    _child_queue = queue


def report_stage(stage: str) -> None:
    """The build's on_stage in the child: logged there, and sent to the serving process."""
    logger.info("build: %s", stage)
    if _child_queue is not None:
        _child_queue.put(stage)


@contextmanager
def forwarded_stages(context: SpawnContext, on_stage: Callable[[str], None]) -> Iterator[Queue[str | None]]:
    """A queue for a child's stages, each handed to `on_stage` on a thread of this process until
    the block ends (after the child has gone, so every stage it sent arrives first)."""
    queue: Queue[str | None] = context.Queue()

    def forward() -> None:
        while (stage := queue.get()) is not None:
            on_stage(stage)

    thread = threading.Thread(target=forward, name="ifb-build-stages", daemon=True)
    thread.start()
    try:
        yield queue
    finally:
        queue.put(None)
        thread.join()
        queue.close()


@dataclass(frozen=True, slots=True)
class _Stage:
    name: str
    started: float


class BuildProgress:
    """The stage of every build running now in this process's children, by target."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._stages: dict[str, _Stage] = {}

    def on_stage(self, target: str) -> Callable[[str], None]:
        def record(stage: str) -> None:
            with self._lock:
                self._stages[target] = _Stage(stage, self._clock())

        return record

    def finished(self, target: str) -> None:
        with self._lock:
            self._stages.pop(target, None)

    def report(self, target: str) -> dict[str, Any] | None:
        """{"stage", "stage_for_s"} of the build of `target` running now; None when there is none."""
        with self._lock:
            stage = self._stages.get(target)
        if stage is None:
            return None
        return {"stage": stage.name, "stage_for_s": round(self._clock() - stage.started, 1)}


BUILDS = BuildProgress()
