"""A process-wide pool of daemon threads that run executor loops, reused across LLM instances.

Reusing threads keeps one OpenMP team per loop thread for the life of the process (every new
thread left another idle team behind, and libgomp slows all teams down once there are more
threads than cores). Daemon threads, unlike concurrent.futures', never block interpreter exit
when an LLM was not closed.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

_idle: queue.SimpleQueue[tuple[Callable[[], None], Future[None]]] = queue.SimpleQueue()
_lock = threading.Lock()
_num_threads = 0
_num_busy = 0


def _worker() -> None:
    global _num_busy
    while True:
        job, future = _idle.get()
        try:
            job()
            future.set_result(None)
        except BaseException as error:  # reported through the future
            future.set_exception(error)
        finally:
            with _lock:
                _num_busy -= 1


def run_on_engine_thread(job: Callable[[], None]) -> Future[None]:
    """Run `job` on an idle pooled thread (a new one only if all are busy)."""
    global _num_threads, _num_busy
    future: Future[None] = Future()
    with _lock:
        _num_busy += 1
        if _num_busy > _num_threads:
            _num_threads += 1
            threading.Thread(target=_worker, name=f"ifb-executor-{_num_threads}", daemon=True).start()
    _idle.put((job, future))
    return future
