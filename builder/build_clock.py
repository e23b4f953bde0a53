"""BuildClock: each build phase's wall time and peak resident memory, for the build summary.

Peak memory is the process's high-water mark (VmHWM), reset at the start of each phase through
/proc/self/clear_refs, so each phase reports its own peak rather than the build's so far; where
/proc cannot be written (not Linux, no permission) the mark is not reset and each phase reports
the peak up to its end. A phase that runs in a child process (compile: builder/compile_process.py)
adds that process's own peak (`count_child`), as the two are resident together; the C++
compiler's processes are not counted.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (since the last reset)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> None:
    try:
        _CLEAR_REFS.write_text("5")  # "5": reset the peak RSS to the current RSS
    except OSError:
        pass


class BuildClock:
    """Times consecutive phases; `start(name)` ends the previous one."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self._current: str | None = None
        self._since = self.started
        self._child_bytes = 0

    def start(self, name: str) -> None:
        self.stop()
        self._current, self._since = name, time.perf_counter()
        self._child_bytes = 0
        _reset_peak()

    def count_child(self, peak_bytes: int) -> None:
        """Add a child process's peak to the current phase's (the child ran inside the phase)."""
        self._child_bytes += peak_bytes

    def stop(self) -> None:
        if self._current is None:
            return
        self.seconds[self._current] = round(time.perf_counter() - self._since, 2)
        self.peak_bytes[self._current] = peak_rss_bytes() + self._child_bytes
        self._current = None

    @property
    def peak_overall_bytes(self) -> int:
        return max(self.peak_bytes.values(), default=peak_rss_bytes())
