"""LoopMailbox: hands the executor's deltas to one asyncio event loop with one wake-up per burst.

The executor emits a delta for every running request each step. Waking the event loop once per
delta (`call_soon_threadsafe` writes to its self-pipe each time) costs a syscall and a GIL
hand-off per token while the executor holds the GIL; posting into a buffer and waking the loop
only when the buffer goes from empty to non-empty costs that once per step.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TypeVar

T = TypeVar("T")


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def post(self, inbox: asyncio.Queue[T], item: T) -> None:
        """Thread-safe; `item` reaches `inbox` on the loop's thread, in posting order."""
        with self._lock:
            self._pending.append((inbox, item))
            wake = len(self._pending) == 1
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: its consumers are gone
                with self._lock:
                    self._pending.clear()

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for inbox, item in batch:
            inbox.put_nowait(item)
