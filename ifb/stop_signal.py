"""SIGTERM stops a server the way Ctrl-C does: through Python's exit path, not around it.

Without this, a SIGTERM skipped every `finally` and atexit hook, and what they close outlived
the server: uvicorn handles SIGTERM itself but re-raises it once it has stopped serving, to the
default action (the process dies before `ifb run` closes its LLM and compile workers); Ray's
driver installs a C++ failure handler for SIGTERM that aborts the process three seconds later
(mid `serve.shutdown()`, leaving the local Ray instance's agents behind).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143) in the main thread, so the caller's
    `finally` blocks run; the previous handler is back afterwards. A no-op off the main thread
    (only it may set signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        # None: the previous handler was not set from Python (it cannot be put back from here)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # One-shot: a second SIGTERM during the clean-up kills at once (the compile workers still
    # notice their parent is gone and exit).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logger.info("SIGTERM: shutting down")
    raise SystemExit(128 + signum)
