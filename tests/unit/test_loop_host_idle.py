"""The loop host's idle turns (runtime/loop_host.py): idle work runs only after a rotation in which no
loop stepped or had work waiting, one step at a time, and the next rotation sees new work first."""

from __future__ import annotations

import threading
from collections.abc import Callable

from waiting import wait_until

from ifb.runtime.loop_host import LoopHost, Turn


class ScriptedLoop:
    """A hosted loop whose turns are `script()`'s answers; its idle work is `idle_steps` steps.
    Every turn and idle step is logged as (name, what) on the host thread."""

    def __init__(self, name: str, log: list[tuple[str, str]], script: Callable[[], Turn], idle_steps: int = 0) -> None:
        self.name, self.log, self.script = name, log, script
        self.idle_steps = idle_steps
        self.stop = threading.Event()

    def turn(self) -> Turn:
        if self.stop.is_set():
            return Turn.ENDED
        turn = self.script()
        self.log.append((self.name, turn.value))
        return turn

    def idle_turn(self) -> bool:
        if self.idle_steps == 0:
            return False
        self.idle_steps -= 1
        self.log.append((self.name, "idle work"))
        return True

    def close(self) -> None:
        pass


def steps_then_idle(num_steps: int) -> Callable[[], Turn]:
    left = [num_steps]

    def script() -> Turn:
        left[0] -= 1
        return Turn.STEPPED if left[0] >= 0 else Turn.IDLE

    return script


def run_until_idle_work_done(a: ScriptedLoop, b: ScriptedLoop) -> None:
    """Hosts a and b until b's idle work is done, then ends both and waits for their loops."""
    host = LoopHost()
    done = [host.attach(a), host.attach(b)]
    wait_until(lambda: b.idle_steps == 0, 10, "b's idle work")
    a.stop.set()
    b.stop.set()
    host.wake()
    for future in done:
        future.result(timeout=10)


def test_idle_work_waits_for_every_loop_to_be_idle() -> None:
    """Loop b has idle work; loop a steps 5 times first. No idle step runs in a rotation where a
    stepped, and once both are idle b's 3 idle steps run one per rotation, each after both turns."""
    log: list[tuple[str, str]] = []
    a = ScriptedLoop("a", log, steps_then_idle(5))
    b = ScriptedLoop("b", log, lambda: Turn.IDLE, idle_steps=3)
    run_until_idle_work_done(a, b)
    idle_at = [i for i, entry in enumerate(log) if entry == ("b", "idle work")]
    assert len(idle_at) == 3
    assert all(entry != ("a", "stepped") for entry in log[idle_at[0] :]), log
    for i in idle_at:  # right after a rotation in which both were idle
        assert log[i - 2 : i] == [("a", "idle"), ("b", "idle")], log


def test_waiting_work_holds_idle_work_back() -> None:
    """A loop with requests it cannot schedule yet (WAITING) is not idle: no idle step runs."""
    log: list[tuple[str, str]] = []
    turns = [Turn.WAITING] * 20
    a = ScriptedLoop("a", log, lambda: turns.pop() if turns else Turn.IDLE)
    b = ScriptedLoop("b", log, lambda: Turn.IDLE, idle_steps=1)
    run_until_idle_work_done(a, b)
    first_idle = log.index(("b", "idle work"))
    assert ("a", "waiting") not in log[first_idle:]
    assert log.count(("a", "waiting")) == 20
