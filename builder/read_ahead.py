"""Produce a build's next module on a worker thread while the caller writes the current one.

The pack phase is a loop of read + pack (numpy and the OS copying out of the mapped file) then write
(the OS copying into the weights file): ~1 s of a 1B Q4_K_M's ~3 s was the write, with the second
core idle. `read_ahead` overlaps the two, bounded so the build's memory stays one module plus at most
`budget` bytes: an item larger than `budget` is handed over alone (the next one is produced only once
the caller has asked past it); otherwise the next item is produced while the caller holds this one.
Items come out in order; an exception raised producing an item is raised to the caller at that item.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

READ_AHEAD_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


@dataclass(frozen=True, slots=True)
class _Item(Generic[T]):
    value: T


def read_ahead(items: Iterator[T], num_bytes: Callable[[T], int], budget: int = READ_AHEAD_BYTES) -> Iterator[T]:
    """`items`, each produced while the caller holds the previous one (see the module docstring)."""
    handoff: queue.Queue[_Item[T] | _Failed | None] = queue.Queue(maxsize=1)
    progress = threading.Condition()
    state = {"received": 0, "done": 0, "stop": False}  # items the caller got / is finished with

    def wait_until_done_with(index: int) -> bool:
        with progress:
            progress.wait_for(lambda: state["done"] > index or bool(state["stop"]))
            return not state["stop"]

    def produce() -> None:
        try:
            for index, value in enumerate(items):
                handoff.put(_Item(value))
                handoff.join()  # taken: only then is the next one produced (two in flight at most)
                if num_bytes(value) > budget and not wait_until_done_with(index):
                    return
                with progress:
                    if state["stop"]:
                        return
            handoff.put(None)
        except BaseException as error:  # handed to the caller, who raises it at this item
            handoff.put(_Failed(error))

    worker = threading.Thread(target=produce, name="ifb-read-ahead", daemon=True)
    worker.start()
    try:
        while True:
            with progress:  # asking for the next item: the caller is done with every one it got
                state["done"] = state["received"]
                progress.notify_all()
            got = handoff.get()
            handoff.task_done()
            if got is None:
                return
            if isinstance(got, _Failed):
                raise got.error
            with progress:
                state["received"] += 1
            yield got.value
    finally:
        with progress:
            state["stop"] = True
            progress.notify_all()
        while worker.is_alive():  # unblock a producer waiting to hand over (the caller stopped early)
            try:
                handoff.get(timeout=0.05)
                handoff.task_done()
            except queue.Empty:
                pass
        worker.join()
