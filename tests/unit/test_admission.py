"""Admission: check_prompt refuses what can never run (naming field and numbers); AdmissionGate seats."""

from __future__ import annotations

import pytest

from ifb.runtime.admission import AdmissionGate, check_prompt, unset_max_tokens
from ifb.runtime.errors import AdmissionError, QueueFullError
from ifb.runtime.windowed_kv_cache_manager import SlidingWindowBlocks

LIMITS = dict(max_seq_len=64, max_blocks=8, block_size=4)  # the pool holds 32 tokens, less than max_seq_len


def refusal(num_prompt_tokens: int, max_tokens: int | None, **limits: int) -> AdmissionError:
    with pytest.raises(AdmissionError) as caught:
        check_prompt(num_prompt_tokens, max_tokens, **{**LIMITS, **limits})
    return caught.value


def test_empty_prompt_is_refused() -> None:
    """Zero prompt tokens: refused on field `prompt`."""
    assert refusal(0, 4).field == "prompt"


@pytest.mark.parametrize("num_prompt_tokens", [64, 65])
def test_prompt_at_or_over_max_seq_len_is_refused(num_prompt_tokens: int) -> None:
    """A prompt of max_seq_len tokens leaves no room to generate: field `prompt`, both numbers named."""
    error = refusal(num_prompt_tokens, None, max_blocks=1000)
    assert error.field == "prompt"
    assert str(num_prompt_tokens) in str(error) and "64" in str(error)


def test_prompt_plus_max_tokens_over_max_seq_len_names_max_tokens() -> None:
    """60 + 10 > 64: field `max_tokens`, message has the prompt, max_tokens, their sum and the limit."""
    error = refusal(60, 10, max_blocks=1000)
    assert error.field == "max_tokens"
    for number in ("60", "10", "70", "64"):
        assert number in str(error)


def test_prompt_plus_max_tokens_equal_to_max_seq_len_is_accepted() -> None:
    """The bound is inclusive: 60 + 4 == 64 fits."""
    check_prompt(60, 4, max_seq_len=64, max_blocks=1000, block_size=4)


def test_more_kv_blocks_than_the_pool_is_refused() -> None:
    """30 + 10 tokens need 10 blocks of 4; the pool holds 8: refused on `max_tokens`, naming 40 and 8."""
    error = refusal(30, 10)
    assert error.field == "max_tokens"
    assert "40" in str(error) and "(8)" in str(error)


def test_exactly_the_pool_size_is_accepted() -> None:
    """28 + 4 = 32 tokens fill all 8 blocks of 4 exactly: accepted."""
    check_prompt(28, 4, **LIMITS)


def test_unset_max_tokens_counts_one_token_for_the_block_check() -> None:
    """max_tokens=None: the prompt plus one token must fit the pool (32 fits, 33 does not)."""
    check_prompt(31, None, **LIMITS)
    assert refusal(32, None).field == "max_tokens"


def test_an_unset_max_tokens_stops_where_the_pool_ends() -> None:
    """The default (512) is cut at max_seq_len and at the pool: a 20-token prompt in a pool of 32
    tokens gets 12, so prompt + max_tokens (what guaranteed_no_evict reserves) fits and the
    request can be admitted; a pool larger than max_seq_len leaves max_seq_len's cut."""
    assert unset_max_tokens(20, 512, **LIMITS) == 12
    assert unset_max_tokens(31, 512, **LIMITS) == 1
    assert unset_max_tokens(20, 5, **LIMITS) == 5
    assert unset_max_tokens(20, 512, max_seq_len=64, max_blocks=1000, block_size=4) == 44


def test_a_window_on_every_layer_lifts_the_pools_cut() -> None:
    """A request of an every-layer window holds at most its window's blocks: the pool (minus
    the null block) bounds the default only when even that peak does not fit."""
    window = SlidingWindowBlocks(window=8, block_size=4, max_num_tokens=4)  # peak: ceil(11 / 4) + 1 = 4
    assert unset_max_tokens(20, 512, window=window, **LIMITS) == 44
    narrow = dict(LIMITS, max_blocks=4)  # 3 usable blocks beside the null block: 12 tokens
    assert unset_max_tokens(5, 512, window=window, **narrow) == 7


class Refusals:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_gate_admits_up_to_capacity() -> None:
    """capacity seats are taken without blocking; the next non-blocking acquire is refused."""
    refusals = Refusals()
    gate = AdmissionGate(3, refusals)
    for _ in range(3):
        gate.acquire(block=False)
    with pytest.raises(QueueFullError, match="3 requests"):
        gate.acquire(block=False)


def test_refusal_calls_on_refused_exactly_once() -> None:
    """Each refused acquire counts once; admitted acquires count nothing."""
    refusals = Refusals()
    gate = AdmissionGate(1, refusals)
    gate.acquire(block=False)
    assert refusals.count == 0
    with pytest.raises(QueueFullError):
        gate.acquire(block=False)
    assert refusals.count == 1


def test_refusal_with_count_refusal_false_is_not_counted() -> None:
    """count_refusal=False still raises QueueFullError but leaves the counter alone."""
    refusals = Refusals()
    gate = AdmissionGate(1, refusals)
    gate.acquire(block=False)
    with pytest.raises(QueueFullError):
        gate.acquire(block=False, count_refusal=False)
    assert refusals.count == 0


def test_blocking_acquire_times_out_into_a_refusal() -> None:
    """A blocking acquire with a timeout on a full gate raises QueueFullError and counts it."""
    refusals = Refusals()
    gate = AdmissionGate(1, refusals)
    gate.acquire()
    with pytest.raises(QueueFullError):
        gate.acquire(block=True, timeout=0.01)
    assert refusals.count == 1


def test_release_gives_a_seat_back() -> None:
    """After a release, one more acquire succeeds (and only one)."""
    refusals = Refusals()
    gate = AdmissionGate(2, refusals)
    gate.acquire(block=False)
    gate.acquire(block=False)
    gate.release()
    gate.acquire(block=False)
    with pytest.raises(QueueFullError):
        gate.acquire(block=False)
    assert refusals.count == 1


def test_release_without_a_seat_taken_is_an_error() -> None:
    """Releasing more than was acquired raises instead of silently growing the capacity."""
    gate = AdmissionGate(1, Refusals())
    with pytest.raises(ValueError):
        gate.release()
