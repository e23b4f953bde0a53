"""How tests wait: on a condition the code exposes, never on the clock.

`wait_until` is the one polling helper of the test suite; its timeout is an upper bound, never a
claim about speed (timings belong in bench/), and it scales with the machine's load: the budget is
what an idle machine needs, stretched by `contention()` (runnable tasks per CPU), so the suite
passes beside other work (`make test-under-load`) without bounds sized for the worst machine. `StepGate` holds the
executor thread before each engine step (Executor.step_started_listeners) until a rule about
the batch holds, so a test can pin the order of events it claims instead of racing the loop.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from ifb.runtime.executor import Executor
from ifb.runtime.request import Request
from ifb.runtime.scheduler import ScheduledBatch

T = TypeVar("T")
POLL_S = 0.01
GATE_TIMEOUT_S = 60.0  # how long a held step waits for its rule before it fails (the test fails)


def contention() -> float:
    """Runnable tasks per CPU over the last minute, at least 1: how much slower than idle this
    machine runs anything now (two busy processes beside the suite on 2 cores: about 2-3)."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def scaled(seconds: float) -> float:
    """An idle machine's bound, stretched by the machine's load now (for waits not through wait_until)."""
    return seconds * contention()


def wait_until(
    condition: Callable[[], T | None],
    timeout_s: float,
    what: str,
    *,
    ignoring: tuple[type[BaseException], ...] = (),
    every_s: float = POLL_S,
    scale_with_load: bool = True,
) -> T:
    """Poll `condition` every `every_s` until it returns something truthy, and return that.
    Raises AssertionError naming `what` once `timeout_s` times the highest contention seen while
    waiting has passed (`timeout_s` alone with `scale_with_load=False`: a bound that is the
    claim itself, e.g. "before Ray's own 60 s timeout"). An exception in `ignoring` counts as
    "not yet"."""
    started = time.monotonic()
    factor = contention() if scale_with_load else 1.0
    last_error: BaseException | None = None
    while True:
        try:
            result = condition()
            if result:
                return result
        except ignoring as error:
            last_error = error
        factor = max(factor, contention()) if scale_with_load else 1.0
        if time.monotonic() - started >= timeout_s * factor:
            detail = f" (last error: {last_error!r})" if last_error is not None else ""
            raise AssertionError(
                f"timed out after {time.monotonic() - started:.0f} s ({timeout_s:g} s x load {factor:.1f}) "
                f"waiting for {what}{detail}"
            )
        time.sleep(every_s)


class StepGate:
    """Holds each engine step on the executor thread until `allow(batch)` is true, and records
    what reached the executor: the requests submitted, the aborts, the steps each request took.

        with StepGate(llm.executor, allow=gate_rule) as gate:  # gate.allow may be changed later
            ...

    A step held past GATE_TIMEOUT_S fails its requests (the executor treats the listener's
    AssertionError as a failed step) and leaving the block raises it, so a rule that is never
    met fails the test instead of hanging it. `submitted` and `aborted` are recorded after the
    executor has the item in its inbox, so a rule that waits on them sees it applied in time.
    """

    def __init__(
        self,
        executor: Executor,
        allow: Callable[[ScheduledBatch], bool] | None = None,
        timeout_s: float = GATE_TIMEOUT_S,
    ) -> None:
        self.executor = executor
        self.allow: Callable[[ScheduledBatch], bool] = allow or (lambda batch: True)
        self.timeout_s = timeout_s
        self.submitted: dict[str, Request] = {}  # in the order the executor got them
        self.aborted: set[str] = set()
        self.steps: Counter[str] = Counter()  # engine steps each request has taken
        self.batch_sizes: list[int] = []
        self.timeouts: list[str] = []

    # -- rules --------------------------------------------------------------------------------
    def first_steps_only(self, batch: ScheduledBatch) -> bool:
        """No request in the batch has stepped before (its prefill is the step to take)."""
        return all(self.steps[item.request_id] == 0 for item in batch.requests)

    def newcomer_or_aborted(self, batch: ScheduledBatch) -> bool:
        """The batch takes some request's first step, or every request in it that has stepped
        before has had its abort sent. A started request then moves on only beside a newcomer's
        first step until its abort reaches the executor: it cannot finish before its client goes.
        (A request submitted while a step is held joins the batch after that one.)"""
        steps = [self.steps[item.request_id] for item in batch.requests]
        return 0 in steps or all(
            n == 0 or item.request_id in self.aborted for n, item in zip(steps, batch.requests, strict=True)
        )

    # -- installing ---------------------------------------------------------------------------
    def __enter__(self) -> StepGate:
        executor = self.executor
        submit, abort = executor.submit, executor.abort

        def recording_submit(request: Request, *args: Any, **kwargs: Any) -> None:
            submit(request, *args, **kwargs)
            self.submitted[request.request_id] = request

        def recording_abort(request_id: str, *args: Any, **kwargs: Any) -> None:
            abort(request_id, *args, **kwargs)
            self.aborted.add(request_id)

        executor.submit = recording_submit  # type: ignore[method-assign]
        executor.abort = recording_abort  # type: ignore[method-assign]
        executor.step_started_listeners.append(self._before_step)
        return self

    def __exit__(self, *exc: object) -> None:
        self.allow = lambda batch: True
        self.executor.step_started_listeners.remove(self._before_step)
        del self.executor.submit  # the instance attributes set above; the methods show again
        del self.executor.abort
        if exc[0] is None:
            assert not self.timeouts, self.timeouts

    def _before_step(self, batch: ScheduledBatch) -> None:
        ids = [item.request_id for item in batch.requests]
        try:
            wait_until(lambda: self.allow(batch), self.timeout_s, f"the step gate to let {ids} step")
        except AssertionError as error:
            self.timeouts.append(str(error))
            raise
        self.steps.update(ids)
        self.batch_sizes.append(len(ids))
