"""The grammar compile pool's ways of not serving: a worker that cannot start refuses the
requests waiting for it (naming their field and why) instead of leaving them waiting forever,
the next request tries a start again, and closing the pool refuses whoever still waits."""

from __future__ import annotations

import os
import threading

import pytest
from waiting import wait_until

from ifb.runtime.errors import AdmissionError, EngineUnavailableError
from ifb.runtime.guided_pool import COMPILE_WORKERS, WorkerPool


def test_a_vocabulary_that_fails_to_load_refuses_each_request_and_is_tried_again() -> None:
    calls: list[int] = []

    def broken_vocabulary() -> str:
        calls.append(1)
        raise ValueError("no tokenizer.json")

    pool = WorkerPool(broken_vocabulary)
    try:
        starts = [0]
        for attempt in range(2):
            with pytest.raises(
                AdmissionError, match="no grammar compile worker could start: no tokenizer.json"
            ) as error:
                pool.acquire("guided_json")
            assert error.value.field == "guided_json"
            # each request tries again, a bounded number of starts, none once it is refused; the
            # first window also holds the pool's own start at construction, which may have failed
            # before the request came (then the request starts COMPILE_WORKERS more) or not yet
            own_start = 1 if attempt == 0 else 0
            assert starts[-1] < len(calls) <= starts[-1] + COMPILE_WORKERS + own_start
            starts.append(len(calls))
        assert pool.worker_pids() == [] and pool.num_waiting == 0
    finally:
        pool.close()


def test_a_worker_that_cannot_load_the_vocabulary_says_why() -> None:
    """A real worker process given a vocabulary xgrammar cannot read exits with its reason."""
    pool = WorkerPool(lambda: "not a tokenizer info")
    try:
        with pytest.raises(AdmissionError, match="no grammar compile worker could start") as error:
            pool.acquire("guided_regex")
        assert error.value.field == "guided_regex" and pool.worker_pids() == []
    finally:
        pool.close()


def test_closing_refuses_the_requests_still_waiting() -> None:
    gate = threading.Event()  # never set: no worker ever starts
    pool = WorkerPool(lambda: "unused", start_gate=gate)
    outcome: list[BaseException] = []

    def request() -> None:
        try:
            pool.acquire("guided_choice")
        except BaseException as error:
            outcome.append(error)

    caller = threading.Thread(target=request, daemon=True)
    caller.start()
    wait_until(lambda: pool.num_waiting == 1, 60, "the request to wait for a worker")
    pool.close()
    caller.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], EngineUnavailableError), outcome
    gate.set()  # the held start sees the pool closed and spawns nothing
    assert pool.worker_pids() == []


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_closing_while_a_worker_starts_ends_it_and_closes_its_socket_once() -> None:
    """The pool's close and a starting worker's own failure path both used to close the worker's
    socket: the second close raised EBADF in the start thread, or closed a descriptor opened
    under the same number in between. Every round here closes while the worker is still loading
    xgrammar (the invalid vocabulary makes it exit with a reason should it get that far)."""
    errors: list[BaseException] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        before = _open_descriptors()
        for _ in range(3):
            pool = WorkerPool(lambda: "not a tokenizer info")
            wait_until(lambda pool=pool: pool.worker_pids() != [], 60, "the worker process to start")
            (pid,) = pool.worker_pids()
            pool.close()
            wait_until(lambda pool=pool: pool.num_starting == 0, 60, "the start thread to finish")
            with pytest.raises(ChildProcessError):  # killed and reaped by close()
                os.waitpid(pid, os.WNOHANG)
        assert errors == []
        assert _open_descriptors() <= before  # an earlier test's worker may close its socket meanwhile
    finally:
        threading.excepthook = previous_hook
