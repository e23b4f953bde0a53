"""Retry-After from the measured drain rate."""

from __future__ import annotations

from ifb.runtime.drain_rate import DrainRate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unknown_rate_says_one_second() -> None:
    assert DrainRate(Clock()).retry_after_s(5) == 1


def test_retry_after_is_the_time_for_the_queue_ahead_to_drain() -> None:
    clock = Clock()
    drain = DrainRate(clock)
    for _ in range(8):  # 2 requests per second over 4 s
        drain.record_finish()
        clock.now += 0.5
    assert drain.retry_after_s(1) == 1
    assert drain.retry_after_s(10) == 5
    assert drain.retry_after_s(10_000) == 60  # clamped


def test_old_finishes_leave_the_window() -> None:
    clock = Clock()
    drain = DrainRate(clock)
    drain.record_finish()
    clock.now += 60
    assert drain.per_second() is None
