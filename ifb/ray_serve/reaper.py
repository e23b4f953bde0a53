"""Ends the local Ray instance that `ifb serve` started when `ifb serve` ends, however it ends.

A clean exit (Ctrl-C, SIGTERM) runs ray.shutdown(), which stops every Ray process. A SIGKILL
skips it: GCS and the raylet notice the dead driver, but Ray's dashboard and runtime-env agents
wait out Ray's own 60 s raylet timeout before they exit, holding memory and ports. So `ifb serve`
starts this watcher (a process of its own, `python -m ifb.ray_serve.reaper PID`) before
ray.init: it remembers the server's descendants while the server lives and, once the server is
gone, stops those still running — SIGTERM, then SIGKILL after a grace period. A process is
named by pid *and* start time, so a pid the kernel gave to someone else meanwhile is left alone.

Linux only (it reads /proc); elsewhere it exits at once and Ray's own timeouts apply.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SCAN_PERIOD_S = 0.5  # how often the server's process tree is read while it lives (~2 ms a scan)
TERM_GRACE_S = 5.0  # SIGTERM's grace before SIGKILL: Ray's agents exit in well under a second


@dataclass(frozen=True, slots=True)
class ProcessId:
    """A process as /proc names it: the pid and the start time that make it unique."""

    pid: int
    start_ticks: int


def _read_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (in parentheses) may hold spaces: split what follows its last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start ticks) of every live process."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := _read_stat(int(entry.name))) is not None:
            table[int(entry.name)] = stat
    return table


def descendants(roots: set[int], table: dict[int, tuple[int, int]]) -> set[ProcessId]:
    """Every process below `roots` in `table` (the roots themselves excluded)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: set[ProcessId] = set()
    pending = list(roots)
    while pending:
        for child in children.get(pending.pop(), ()):
            found.add(ProcessId(child, table[child][1]))
            pending.append(child)
    return found


def _still_running(processes: set[ProcessId]) -> set[ProcessId]:
    alive = set()
    for process in processes:
        stat = _read_stat(process.pid)
        if stat is not None and stat[1] == process.start_ticks:
            alive.add(process)
    return alive


def _signal_all(processes: set[ProcessId], signum: int) -> None:
    for process in processes:
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            pass


def stop_orphans(remembered: set[ProcessId]) -> None:
    """Stop what is left of the server's tree: the processes remembered, and whatever they
    started since the last scan (orphans now, so found from them, not from the server)."""
    table = process_table()
    left = _still_running(remembered)
    left |= descendants({p.pid for p in left}, table)
    left.discard(ProcessId(os.getpid(), table.get(os.getpid(), (0, 0))[1]))
    if not left:
        return
    logger.info("ifb serve is gone: stopping %d process(es) of its Ray instance", len(left))
    _signal_all(left, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while (left := _still_running(left)) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal_all(left, signal.SIGKILL)


def watch(server_pid: int) -> None:
    """Remember `server_pid`'s descendants until it is no longer this process's parent, then
    stop them."""
    me = os.getpid()
    remembered: set[ProcessId] = set()
    while os.getppid() == server_pid:
        tree = descendants({server_pid}, process_table())
        remembered = _still_running(remembered) | {p for p in tree if p.pid != me}
        time.sleep(SCAN_PERIOD_S)
    stop_orphans(remembered)


def start_reaper() -> subprocess.Popen[bytes] | None:
    """Start the watcher for this process (None where /proc is missing). It ignores SIGINT and
    SIGTERM, which a terminal or a supervisor sends to the whole process group: it must outlive
    the server to clean up after it, and it exits by itself once the server is gone."""
    if not Path("/proc/self/stat").exists():
        return None
    command = [sys.executable, "-m", "ifb.ray_serve.reaper", str(os.getpid())]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch(int(sys.argv[1]))
