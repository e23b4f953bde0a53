"""LoopHost: the one thread that runs every executor loop of the process, one turn each in rotation.

Why one thread for every loaded model: libgomp gives each thread that runs OpenMP work a team of
worker threads that outlives the work, and once a process manages more such threads than it has
cores it throttles every team's spin-wait, so every parallel region pays a futex wake-up. On the
2-core Xeon, 200 parallel adds took 21 ms on one thread and 34 ms (1.6x) while a second thread
that had once run the same work sat idle; a thread that ran OpenMP work and exited left no cost
(its team goes with it). With a loop thread per model, a busy SmolLM2 ran at 0.22-0.24 x its
speed alone while a second copy sat loaded and idle, and two busy copies at 0.69-0.72 x one
(bench/shared_cores.py, quiet; 0.99-1.02 x and 0.94-0.99 x on the loop host). On one thread the models' steps take turns with one team, each step using every
core (`--threads`); engines are loaded on short-lived threads (Executor.start), so a load runs
beside the others' steps and leaves nothing behind.

Fairness: a rotation gives each loop one turn, at most one step, so busy models alternate step
by step (a long prefill step of one model delays the other's next token by that step). A step
that hangs holds every model; the hanging model's watchdog reports it (/health: stuck).

Idle work (a cost model timed on the serving engine, step_budget/idle_calibration.py) gets a turn
only after a rotation in which no loop stepped or had work waiting, one loop's one step at a time,
and the next rotation checks every inbox first: a request arriving waits for at most that step.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

logger = logging.getLogger(__name__)

# With work that cannot start yet (waiting requests, nothing schedulable) a loop is polled this
# often; with none, this often (a queue timeout still expires within it) unless woken.
_WAITING_POLL_S = 0.001
_IDLE_POLL_S = 0.5


class Turn(Enum):
    """What one turn of a loop did."""

    STEPPED = "stepped"  # ran a step: give it another turn soon
    WAITING = "waiting"  # has requests, none schedulable now: poll again shortly
    IDLE = "idle"  # nothing to do until a request or an abort arrives (wake())
    ENDED = "ended"  # stopped and closed: drop it


class HostedLoop(Protocol):
    def turn(self) -> Turn:
        """One iteration on the host thread; an exception ends this loop only."""
        ...

    def idle_turn(self) -> bool:
        """One step of background work while every loop is idle; False if it has none."""
        ...

    def close(self) -> None:
        """After its last turn, on a thread of its own: ending requests and flushing the KV
        pool's cached blocks to disk can take seconds the other loops' steps must not wait."""
        ...


@dataclass(frozen=True, slots=True)
class _Hosted:
    loop: HostedLoop
    done: Future[None]


class LoopHost:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosted: list[_Hosted] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_idle = 0  # whose idle work goes first: loops take turns at it too

    def attach(self, loop: HostedLoop) -> Future[None]:
        """Run `loop`'s turns on the host thread from now on; the future ends with the loop
        (its exception if a turn raised)."""
        hosted = _Hosted(loop, Future())
        with self._lock:
            self._hosted.append(hosted)
            if self._thread is None:  # daemon: a process that never closed its LLMs still exits
                self._thread = threading.Thread(target=self._run, name="ifb-loop-host", daemon=True)
                self._thread.start()
        self.wake()
        return hosted.done

    def wake(self) -> None:
        """Thread-safe: a request, an abort or a stop arrived for some loop."""
        self._wake.set()

    def is_host_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before the turns: a wake() during them ends the wait at once
            with self._lock:
                hosted = list(self._hosted)
            turns = [self._turn(h) for h in hosted]
            if Turn.STEPPED in turns:
                continue
            idle = [h for h, turn in zip(hosted, turns, strict=True) if turn is Turn.IDLE]
            if Turn.WAITING not in turns and self._idle_turn(idle):
                continue
            self._wake.wait(_WAITING_POLL_S if Turn.WAITING in turns else _IDLE_POLL_S)

    def _turn(self, hosted: _Hosted) -> Turn:
        try:
            turn = hosted.loop.turn()
        except BaseException as error:  # reported through its future; the other loops go on
            self._end(hosted, error)
            return Turn.ENDED
        if turn is Turn.ENDED:
            self._end(hosted, None)
        return turn

    def _idle_turn(self, hosted: list[_Hosted]) -> bool:
        """The first idle loop from `_next_idle` on with idle work runs one step of it."""
        for offset in range(len(hosted)):
            index = (self._next_idle + offset) % len(hosted)
            if hosted[index].loop.idle_turn():
                self._next_idle = index + 1
                return True
        return False

    def _end(self, hosted: _Hosted, error: BaseException | None) -> None:
        with self._lock:
            self._hosted.remove(hosted)
        threading.Thread(target=_close, args=(hosted, error), name="ifb-loop-close", daemon=True).start()


def _close(hosted: _Hosted, error: BaseException | None) -> None:
    try:
        hosted.loop.close()
    except BaseException as close_error:  # the loop's own error, if any, is the one to report
        logger.exception("closing a step loop failed")
        error = error or close_error
    if error is None:
        hosted.done.set_result(None)
    else:
        hosted.done.set_exception(error)


LOOP_HOST = LoopHost()
