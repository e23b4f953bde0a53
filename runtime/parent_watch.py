"""A worker process that ends with the process that started it, however that one ends (SIGKILL too).

Used by guided decoding's grammar compile workers and by the builder's step-compile process.
"""

from __future__ import annotations

import os
import threading
import time

PARENT_POLL_S = 0.5  # how often a worker checks that the process that started it is alive


def exit_with_parent(parent_pid: int) -> None:
    """End this process once `parent_pid` is no longer its parent.

    A thread polls os.getppid() against the pid the parent passed in, rather than prctl's
    PR_SET_PDEATHSIG: that fires when the parent *thread* that spawned the worker exits, and
    ProcessPoolExecutor spawns from whichever thread submits (a caller's short-lived thread
    would take the pool down with it); it is Linux-only too. Comparing with the passed-in pid
    also catches a parent that died before this worker started, and reparenting to a subreaper
    rather than init. xgrammar and the C++ compiler release the GIL while they work, so the
    check runs mid-compile.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)  # nothing to flush: the parent that wanted the result is gone

    threading.Thread(target=watch, name="ifb-parent-watch", daemon=True).start()
