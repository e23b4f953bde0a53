"""Chunking policies' split() at the edges (tiny budgets, last chunks, alignment, many requests) and
the scheduler counters' live/frozen pair."""

from __future__ import annotations

import dataclasses
import random

import pytest
from fakes import make_request

from ifb.runtime.policies import ChunkingPolicy, ChunkingPolicyKind, make_chunking_policy
from ifb.runtime.request import Request
from ifb.runtime.scheduler_stats import SchedulerStats

FCFS = ChunkingPolicyKind.FIRST_COME_FIRST_SERVED
EQUAL = ChunkingPolicyKind.EQUAL_PROGRESS
BOTH = list(ChunkingPolicyKind)
BLOCK = 4


def prefilling(remaining: int, computed: int = 0) -> Request:
    """A prompt of computed + remaining tokens with `computed` of them already in the pool."""
    request = make_request(computed + remaining, 4)
    request.num_computed_tokens = computed
    return request


def split(kind: ChunkingPolicyKind, requests: list[Request], budget: int, block_size: int = BLOCK) -> list[int]:
    """Chunk sizes per request, in the order of `requests` (0 = no chunk this step)."""
    sizes = {id(r): size for r, size in make_chunking_policy(kind).split(requests, budget, block_size)}
    return [sizes.get(id(r), 0) for r in requests]


@pytest.mark.parametrize("kind", BOTH)
def test_budget_below_one_block_gives_a_long_prompt_nothing(kind: ChunkingPolicyKind) -> None:
    """3 tokens of budget with block_size 4: no aligned chunk fits, so no chunk (not a ragged 3)."""
    assert split(kind, [prefilling(10)], budget=3) == [0]


@pytest.mark.parametrize("kind", BOTH)
def test_budget_below_one_block_still_finishes_a_short_rest(kind: ChunkingPolicyKind) -> None:
    """A last chunk of 2 tokens fits a 3-token budget: it need not end on a block boundary."""
    assert split(kind, [prefilling(2, computed=8)], budget=3) == [2]


@pytest.mark.parametrize("kind", BOTH)
def test_budget_of_whole_blocks_is_used_entirely_by_one_request(kind: ChunkingPolicyKind) -> None:
    """Budget 8 = two blocks: a single long prompt takes all of it."""
    assert split(kind, [prefilling(20)], budget=8) == [8]


@pytest.mark.parametrize("kind", BOTH)
def test_single_request_that_fits_takes_its_whole_rest(kind: ChunkingPolicyKind) -> None:
    """Remaining 7 under a budget of 16: one chunk of 7 completes the prompt."""
    assert split(kind, [prefilling(7)], budget=16) == [7]


@pytest.mark.parametrize("kind", BOTH)
def test_chunk_ends_on_a_block_boundary_from_a_mid_prompt_start(kind: ChunkingPolicyKind) -> None:
    """From position 4 with budget 10, the chunk stops at 12 (a boundary), not 14: 8 tokens."""
    assert split(kind, [prefilling(20, computed=4)], budget=10) == [8]


@pytest.mark.parametrize("kind", BOTH)
def test_unaligned_start_is_brought_back_to_a_boundary(kind: ChunkingPolicyKind) -> None:
    """From position 5 with budget 8, the chunk ends at 12: 7 tokens (re-aligning the request)."""
    assert split(kind, [prefilling(20, computed=5)], budget=8) == [7]


@pytest.mark.parametrize("kind", BOTH)
def test_short_last_chunks_all_finish_when_they_fit(kind: ChunkingPolicyKind) -> None:
    """Rests of 2, 3 and 1 tokens (each under a block) all complete within a budget of 8."""
    assert split(kind, [prefilling(2, 4), prefilling(3, 8), prefilling(1, 12)], budget=8) == [2, 3, 1]


def test_fcfs_gives_the_oldest_request_the_whole_budget() -> None:
    """FCFS: with more long prompts than budget / block_size, the first takes all 8 tokens."""
    assert split(FCFS, [prefilling(100) for _ in range(5)], budget=8) == [8, 0, 0, 0, 0]


def test_fcfs_passes_what_the_first_cannot_use_to_the_next() -> None:
    """The first needs only 3 of 16; the second gets the rest rounded down to a boundary (12)."""
    assert split(FCFS, [prefilling(3), prefilling(100)], budget=16) == [3, 12]


def test_equal_progress_gives_one_block_each_while_blocks_last() -> None:
    """More long prompts than blocks in the budget: the first two get one block each, the rest none."""
    assert split(EQUAL, [prefilling(100) for _ in range(5)], budget=8) == [4, 4, 0, 0, 0]


def test_equal_progress_shares_the_budget_evenly_in_whole_blocks() -> None:
    """Two long prompts and a 16-token budget: 8 each."""
    assert split(EQUAL, [prefilling(100), prefilling(100)], budget=16) == [8, 8]


def test_equal_progress_hands_leftover_budget_to_the_others() -> None:
    """A 2-token rest leaves budget the long prompt then takes in whole blocks: 2 + 12 of 16."""
    assert split(EQUAL, [prefilling(2), prefilling(100)], budget=16) == [2, 12]


def random_workload(rng: random.Random) -> tuple[list[Request], int, int]:
    block_size = rng.choice([1, 2, 4, 8, 16])
    requests = [
        prefilling(rng.randint(1, 60), rng.randint(0, 6) * block_size + rng.choice([0, 0, 0, 1]))
        for _ in range(rng.randint(1, 7))
    ]
    return requests, rng.randint(0, 64), block_size


@pytest.mark.parametrize("kind", BOTH)
def test_chunks_respect_budget_rest_and_block_boundaries_on_random_workloads(kind: ChunkingPolicyKind) -> None:
    """Seeded random splits: total <= budget; each chunk in (0, rest]; a non-final chunk ends on a boundary;
    chunks keep the requests' order."""
    rng = random.Random(0)
    policy: ChunkingPolicy = make_chunking_policy(kind)
    for _ in range(500):
        requests, budget, block_size = random_workload(rng)
        chunks = policy.split(requests, budget, block_size)
        assert sum(size for _, size in chunks) <= budget
        order = [requests.index(r) for r, _ in chunks]
        assert order == sorted(set(order))
        for request, size in chunks:
            assert 0 < size <= request.num_tokens_to_compute
            if size < request.num_tokens_to_compute:
                assert (request.num_computed_tokens + size) % block_size == 0


def test_equal_progress_advances_every_request_when_the_budget_allows() -> None:
    """Seeded random workloads with budget >= requests * block_size: every prefill gets a chunk."""
    rng = random.Random(1)
    policy = make_chunking_policy(EQUAL)
    for _ in range(500):
        requests, _, block_size = random_workload(rng)
        budget = len(requests) * block_size + rng.randint(0, 3 * block_size)
        sizes = [size for _, size in policy.split(requests, budget, block_size)]
        assert len(sizes) == len(requests) and all(sizes)


def test_make_chunking_policy_returns_distinct_behaviours() -> None:
    """Each enum value builds its own policy: the two split the same workload differently."""
    requests = [prefilling(100), prefilling(100)]
    assert split(FCFS, requests, budget=16) == [16, 0]
    assert split(EQUAL, requests, budget=16) == [8, 8]


def test_freeze_copies_every_value() -> None:
    """Every field set to a distinct value comes out of freeze() unchanged."""
    stats = SchedulerStats()
    expected = {}
    for index, f in enumerate(dataclasses.fields(SchedulerStats), start=1):
        value = index + 0.5 if isinstance(getattr(stats, f.name), float) else index
        setattr(stats, f.name, value)
        expected[f.name] = value
    counters = stats.freeze()
    assert {name: getattr(counters, name) for name in expected} == expected


def test_freeze_is_a_snapshot() -> None:
    """Counting after freeze() leaves the frozen copy as it was."""
    stats = SchedulerStats(submitted=3)
    counters = stats.freeze()
    stats.submitted += 1
    stats.record_queue_latency(2.0)
    assert counters.submitted == 3 and counters.num_admitted == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        counters.submitted = 5  # type: ignore[misc]
