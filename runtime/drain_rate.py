"""DrainRate: how fast requests leave the engine, so a 429's Retry-After says when a seat is
likely to free instead of a fixed 1 s that makes every client retry at once."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

WINDOW_S = 10.0
MIN_RETRY_S, MAX_RETRY_S = 1, 60


class DrainRate:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._finishes: deque[float] = deque(maxlen=4096)
        self._lock = threading.Lock()

    def record_finish(self) -> None:
        """Called once per finished request (on the executor thread)."""
        with self._lock:
            self._finishes.append(self._clock())

    def per_second(self) -> float | None:
        now = self._clock()
        with self._lock:
            recent = [t for t in self._finishes if now - t <= WINDOW_S]
        if not recent:
            return None
        return len(recent) / max(now - recent[0], 1.0)  # over at least a second

    def retry_after_s(self, num_ahead: int) -> int:
        """Seconds until `num_ahead` requests have likely left, clamped to [1, 60]."""
        rate = self.per_second()
        if rate is None:
            return MIN_RETRY_S
        return max(MIN_RETRY_S, min(MAX_RETRY_S, math.ceil(num_ahead / rate)))
