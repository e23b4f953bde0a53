"""WindowedKVCacheManager: blocks that slid out of an every-layer window go back to the pool.

Pins: a block is freed exactly when its last position p satisfies p <= n - window (n computed
tokens), whole chunks included; the null block stands in for it, is never handed out, counted
or freed; freed blocks stay in the prefix cache and a later prompt reuses them; speculative
rollback and preemption handle tables with holes; guaranteed_no_evict admits by a request's
windowed peak and no request gets stuck, shared prefixes included; a model with a global layer
(or a window no sequence outgrows) keeps every block. The fake engine checks integrity each step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest
from engine_records import SPEC
from fakes import FakeEngine, expected_outputs, make_request

from ifb.runtime.admission import check_prompt
from ifb.runtime.errors import AdmissionError
from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind, make_capacity_policy, make_chunking_policy
from ifb.runtime.request import Request, RequestState
from ifb.runtime.scheduler import Scheduler, SchedulerConfig
from ifb.runtime.speculation.planner import SpeculationPlanner
from ifb.runtime.speculation.prompt_lookup import PromptLookupProposer
from ifb.runtime.step_budget.budgets import FixedBudget
from ifb.runtime.windowed_kv_cache_manager import SlidingWindowBlocks, WindowedKVCacheManager, make_kv_cache_manager

BLOCK = 4


def windowed_kv(num_blocks: int = 32, window: int = 6, max_num_tokens: int = 8) -> WindowedKVCacheManager:
    return WindowedKVCacheManager(num_blocks, SlidingWindowBlocks(window, BLOCK, max_num_tokens))


def windowed_scheduler(
    *,
    num_blocks: int,
    window: int | None = 8,
    policy: CapacityPolicyKind = CapacityPolicyKind.GUARANTEED_NO_EVICT,
    max_num_tokens: int = 8,
    max_batch_size: int = 4,
    prefix_reuse: bool = True,
) -> Scheduler:
    """make_scheduler's scheduler over the KV manager the factory picks for `window`."""
    blocks = None if window is None else SlidingWindowBlocks(window, BLOCK, max_num_tokens)
    kv = make_kv_cache_manager(num_blocks, BLOCK, prefix_reuse, blocks)
    return Scheduler(
        SchedulerConfig(max_batch_size, max_num_tokens, max_seq_len=256),
        kv,
        make_capacity_policy(policy, kv),
        make_chunking_policy(ChunkingPolicyKind.FIRST_COME_FIRST_SERVED),
        FixedBudget(),
    )


def compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What a step and Scheduler.update do to the request: blocks, computed count, advance."""
    assert kv.allocate(request, num_tokens)
    request.num_computed_tokens += num_tokens
    kv.advance(request)


def dead_by_position(num_blocks: int, num_computed: int, window: int) -> list[int]:
    """Blocks none of whose positions a query at num_computed or later reads (the attention's
    rule, position by position: a query at i reads p with i - window < p <= i)."""
    first_read = num_computed - window + 1
    return [b for b in range(num_blocks) if all(p < first_read for p in range(b * BLOCK, (b + 1) * BLOCK))]


def holes(kv: WindowedKVCacheManager, request: Request) -> list[int]:
    return [i for i, b in enumerate(request.block_ids) if b == kv.null_block_id]


def run(scheduler: Scheduler, requests: Sequence[Request], check: Callable[[Scheduler], None] | None = None) -> int:
    engine = FakeEngine(scheduler)
    for request in requests:
        scheduler.add(request)
    steps = 0
    while scheduler.has_work:
        engine.step()  # checks integrity
        if check is not None:
            check(scheduler)
        steps += 1
        assert steps < 5_000, "a request is stuck"
    return steps


@pytest.mark.parametrize("window", [1, 3, 4, 6, 9])
def test_a_block_is_freed_exactly_when_its_last_position_leaves_the_window(window: int) -> None:
    """One token at a time to 40: after each, the holes are exactly the blocks the attention
    rule says are dead, and the pool counts only the others as used."""
    kv = windowed_kv(window=window)
    request = make_request(40, 1)
    kv.admit(request, [])
    for n in range(1, 41):
        compute(kv, request, 1)
        assert holes(kv, request) == dead_by_position(len(request.block_ids), n, window), n
        assert kv.num_used_blocks == len(request.block_ids) - len(holes(kv, request))
        kv.check_integrity([request])


def test_the_boundary_is_last_position_equal_to_n_minus_window() -> None:
    """Window 6, blocks of 4: block 0 (positions 0..3) is still read by the query at 8 (keys 3..8)
    and dead once 9 are computed (the next query, at 9, reads 4..9); block 1 (4..7) at 13."""
    kv = windowed_kv(window=6)
    request = make_request(20, 1)
    kv.admit(request, [])
    compute(kv, request, 8)
    assert holes(kv, request) == []
    compute(kv, request, 1)
    assert holes(kv, request) == [0]
    compute(kv, request, 3)  # n = 12: block 1's last position 7 > 12 - 6
    assert holes(kv, request) == [0]
    compute(kv, request, 1)
    assert holes(kv, request) == [0, 1]


def test_a_chunk_frees_every_block_it_slides_past() -> None:
    """A 24-token chunk at once: 4 of its 6 blocks are dead (last position 15 <= 24 - 6)."""
    kv = windowed_kv(window=6)
    request = make_request(24, 1)
    kv.admit(request, [])
    compute(kv, request, 24)
    assert holes(kv, request) == [0, 1, 2, 3]
    assert (kv.num_used_blocks, kv.num_free_blocks) == (2, kv.num_blocks - 2)
    kv.check_integrity([request])


def test_the_null_block_is_reserved_never_handed_out_and_never_freed() -> None:
    """A pool of 9 blocks gives requests 8; the 9th (the null block) appears only as a hole, in
    the free list never, however often the pool is drained and refilled."""
    kv = windowed_kv(num_blocks=9, window=4)
    assert (kv.num_blocks, kv.num_free_blocks, kv.null_block_id) == (8, 8, 8)
    rng = random.Random(3)
    for _ in range(30):
        live = [make_request(0, 1, prompt=[rng.randrange(3, 99) for _ in range(rng.randint(1, 24))])]
        kv.admit(live[0], [])
        while kv.allocate(live[-1], 1):
            request = live[-1]
            request.num_computed_tokens += 1
            kv.advance(request)
            dead = kv.window.num_dead_blocks(request.num_computed_tokens)
            assert kv.null_block_id not in request.block_ids[dead:]
            if request.num_computed_tokens == request.num_tokens:
                live.append(make_request(0, 1, prompt=[rng.randrange(3, 99) for _ in range(rng.randint(1, 24))]))
                kv.admit(live[-1], kv.match_prefix(live[-1]))
            kv.check_integrity(live)
        for request in live:
            kv.free(request)
        kv.check_integrity([])
        assert kv.num_free_blocks == 8
    assert kv.null_block_id not in kv._free


def test_freed_blocks_stay_cached_and_a_later_prompt_reuses_them() -> None:
    """A's 24-token prompt frees its first 4 blocks, but they stay in the prefix cache: B's
    identical prompt (plus one token) hits all 24 tokens, its dead 4 entries holes from the start
    (nothing B reads), and B shares A's 2 live blocks."""
    kv = windowed_kv(window=6)
    prompt = list(range(10, 34))
    a = make_request(0, 4, prompt=prompt)
    kv.admit(a, kv.match_prefix(a))
    assert kv.allocate(a, 24)
    table = list(a.block_ids)
    a.num_computed_tokens = 24
    kv.advance(a)
    assert holes(kv, a) == [0, 1, 2, 3] and kv.num_cached_blocks == 6
    b = make_request(0, 4, prompt=[*prompt, 7])
    hits = kv.match_prefix(b)
    assert hits == [kv.null_block_id] * 4 + table[4:]
    kv.admit(b, hits)
    assert b.num_computed_tokens == 24 and b.block_ids == a.block_ids
    assert [kv.blocks[i].ref_count for i in table[4:]] == [2, 2]
    assert kv.num_cached_blocks == 6 and kv.prefix_hit_tokens == 24
    kv.check_integrity([a, b])
    compute(kv, b, 1)
    kv.free(a), kv.free(b)
    kv.check_integrity([])


def test_a_prefix_whose_dead_blocks_were_evicted_still_hits_from_the_right() -> None:
    """A's 24-token prompt (window 6) gives back blocks 0-3 as it computes, then the rest as it
    finishes: 3, 2, 1, 0 and then 5, 4 join the free list's tail. A stranger's 9 blocks take the 5
    never used and evict 0-3, leaving 4-5 (what a query at position 24 reads) cached. B's same
    prompt still hits all 24 tokens (matched from block 0 it hit none); C's, whose block 5
    differs, hits nothing: a query at 20 reads block 3, which is gone."""
    kv = windowed_kv(num_blocks=12, window=6)
    prompt = list(range(10, 34))
    a = make_request(0, 4, prompt=prompt)
    kv.admit(a, kv.match_prefix(a))
    compute(kv, a, 24)
    live = a.block_ids[4:]
    kv.free(a)
    stranger = make_request(0, 4, prompt=list(range(100, 136)))
    kv.admit(stranger, kv.match_prefix(stranger))
    assert kv.allocate(stranger, 36) and kv.num_free_blocks == 2 and kv.num_cached_blocks == 2
    b = make_request(0, 4, prompt=[*prompt, 7])
    hits = kv.match_prefix(b)
    assert hits == [kv.null_block_id] * 4 + live
    assert kv.num_free_among(hits) == 2
    kv.admit(b, hits)
    assert b.num_computed_tokens == 24 and b.block_ids == hits and kv.num_free_blocks == 0
    kv.check_integrity([stranger, b])
    c = make_request(0, 4, prompt=[*prompt[:20], 1, 2, 3, 4, 7])
    assert kv.match_prefix(c) == []
    kv.free(b), kv.free(stranger)
    kv.check_integrity([])


def test_release_beyond_drops_rejected_drafts_and_keeps_the_holes() -> None:
    """A decode past the window verifies 3 drafts. All rejected: the block that held only drafts
    goes back, the holes stay. Two kept: their blocks stay, and one more block slides out."""
    kv = windowed_kv(window=6)
    request = make_request(13, 8)
    kv.admit(request, [])
    compute(kv, request, 13)
    request.token_ids.append(500)  # its first output, at position 13
    assert holes(kv, request) == [0, 1] and len(request.block_ids) == 4
    assert kv.allocate(request, 1 + 3)  # positions 13..16: block 4 holds only drafts
    assert len(request.block_ids) == 5
    request.num_computed_tokens += 1  # every draft rejected: the token, then the model's own
    request.token_ids.append(501)
    kv.release_beyond(request, request.num_tokens)
    kv.advance(request)
    assert len(request.block_ids) == 4 and holes(kv, request) == [0, 1]
    kv.check_integrity([request])
    assert kv.allocate(request, 1 + 3)  # positions 14..17
    request.num_computed_tokens += 3  # two drafts kept, then the model's token
    request.token_ids += [502, 503, 504]
    kv.release_beyond(request, request.num_tokens)
    kv.advance(request)  # n = 17: block 2's last position 11 <= 17 - 6
    assert len(request.block_ids) == 5 and holes(kv, request) == [0, 1, 2]
    kv.check_integrity([request])


def test_speculative_decoding_past_the_window_outputs_as_one_token_at_a_time() -> None:
    """Prompt lookup drafts (some rejected) on requests far longer than the window: outputs equal
    the one-token-at-a-time outputs, every step's integrity holds, every block comes back."""
    prompts = [[*range(100 + 50 * i, 140 + 50 * i), *range(100 + 50 * i, 111 + 50 * i)] for i in range(3)]
    requests = [make_request(0, 40, prompt=p) for p in prompts]
    scheduler = windowed_scheduler(num_blocks=64, policy=CapacityPolicyKind.MAX_UTILIZATION, max_num_tokens=24)
    scheduler.speculation = SpeculationPlanner(PromptLookupProposer(1, 3), 4)
    run(scheduler, requests)
    assert scheduler.stats.spec_num_accepted_tokens > 0
    assert [r.output_token_ids for r in requests] == expected_outputs(requests)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_preemption_frees_a_table_with_holes_and_the_request_recomputes() -> None:
    """max_utilization on a pool too small for four long requests at once: some are preempted
    while holding holes, and every output is still what one token at a time gives."""
    requests = [make_request(12, 60) for _ in range(4)]
    scheduler = windowed_scheduler(num_blocks=9, policy=CapacityPolicyKind.MAX_UTILIZATION, max_num_tokens=64)
    kv = scheduler.kv
    assert isinstance(kv, WindowedKVCacheManager)
    preempt, holes_at_preemption = scheduler._preempt, []

    def recorded(request: Request) -> None:
        holes_at_preemption.append(len(holes(kv, request)))
        preempt(request)

    scheduler._preempt = recorded  # type: ignore[method-assign]
    run(scheduler, requests)
    assert max(holes_at_preemption, default=0) > 0
    assert [r.output_token_ids for r in requests] == expected_outputs(requests)
    assert all(r.block_ids == [] for r in requests)


@pytest.mark.parametrize(("window", "seated"), [(None, 1), (8, 3)], ids=["keep_all", "window_8"])
def test_guaranteed_no_evict_admits_by_the_windowed_peak(window: int | None, seated: int) -> None:
    """Each request (8 + 40 tokens) needs 12 blocks whole but at most 5 at once (window 8,
    chunks <= 8: ceil(15 / 4) + 1). A pool of 16 usable runs one at a time without freeing and
    three at once with it; none is preempted, each holds at most its peak, all finish."""
    most_running = 0

    def within_peaks(scheduler: Scheduler) -> None:
        nonlocal most_running
        most_running = max(most_running, len(scheduler.running))
        kv = scheduler.kv
        if isinstance(kv, WindowedKVCacheManager):
            assert all(len(r.block_ids) - len(holes(kv, r)) <= 5 for r in scheduler.running)

    requests = [make_request(8, 40) for _ in range(4)]
    scheduler = windowed_scheduler(num_blocks=16 if window is None else 17, window=window)
    run(scheduler, requests, within_peaks)
    assert most_running == seated
    assert scheduler.stats.preempted == 0
    assert [r.output_token_ids for r in requests] == expected_outputs(requests)


def test_a_shared_block_counts_as_its_holders_need_until_one_alone_holds_it() -> None:
    """When B shares A's live blocks, A's need to completion grows by them: A dropping a shared
    block frees nothing while B holds it, and A may then grow to its peak."""
    kv = windowed_kv(window=6, max_num_tokens=8)
    prompt = list(range(10, 34))
    a = make_request(0, 20, prompt=prompt)
    kv.admit(a, [])
    compute(kv, a, 24)
    alone = kv.blocks_needed_to_completion(a)
    b = make_request(0, 20, prompt=[*prompt, 5])
    hits = kv.match_prefix(b)
    assert kv.blocks_needed_to_admit(b, hits) == kv.window.max_blocks_held(b.max_total_tokens)
    kv.admit(b, hits)
    assert kv.blocks_needed_to_completion(a) == alone + 2
    kv.free(b)
    assert kv.blocks_needed_to_completion(a) == alone


@pytest.mark.parametrize("policy", list(CapacityPolicyKind))
@pytest.mark.parametrize("seed", range(4))
def test_random_shared_prefix_workloads_never_overcommit_or_stick(policy: CapacityPolicyKind, seed: int) -> None:
    """Random arrivals of prompts sharing 0, 8 or 16-token prefixes, on a tight pool: integrity
    every step; under the no-evict policies, the running requests' peaks never exceed the pool
    and each holds at most its peak (so none can be stuck); every output is right."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(16)]
    scheduler = windowed_scheduler(num_blocks=18, policy=policy, max_batch_size=6)
    kv = scheduler.kv
    assert isinstance(kv, WindowedKVCacheManager)

    def no_overcommit(s: Scheduler) -> None:
        if policy is CapacityPolicyKind.MAX_UTILIZATION:
            return
        peaks = [kv.window.max_blocks_held(r.max_total_tokens) for r in s.running]
        assert sum(peaks) <= kv.num_blocks
        for r, peak in zip(s.running, peaks, strict=True):
            assert len(r.block_ids) - len(holes(kv, r)) <= peak

    engine = FakeEngine(scheduler)
    requests: list[Request] = []
    for step in range(400):
        if step < 200 and rng.random() < 0.3:
            head = shared[: rng.choice([0, 8, 16])]
            prompt = head + [rng.randrange(3, 300) for _ in range(rng.randint(1, 20))]
            requests.append(make_request(0, rng.randint(1, 50), prompt=prompt))
            scheduler.add(requests[-1])
        if scheduler.has_work:
            engine.step()
            no_overcommit(scheduler)
    run(scheduler, [], no_overcommit)
    assert all(r.state is RequestState.FINISHED for r in requests)
    assert [r.output_token_ids for r in requests] == expected_outputs(requests)
    assert kv.num_free_blocks == kv.num_blocks


def test_only_a_window_on_every_layer_that_a_sequence_outgrows_frees_blocks() -> None:
    """Mistral-like: freeing. Gemma-3-like (a global layer), no window, or a window at least
    max_seq_len: the plain manager, which keeps every block and reserves no null block."""
    local = replace(SPEC, num_layers=2, sliding_window=16)
    assert SlidingWindowBlocks.for_model(local, BLOCK, 128, 32) == SlidingWindowBlocks(16, BLOCK, 32)
    assert SlidingWindowBlocks.for_model(replace(local, full_attention_layers=(1,)), BLOCK, 128, 32) is None
    assert SlidingWindowBlocks.for_model(SPEC, BLOCK, 128, 32) is None
    assert SlidingWindowBlocks.for_model(local, BLOCK, 16, 32) is None
    plain = make_kv_cache_manager(16, BLOCK, True, None)
    assert type(plain) is KVCacheManager and plain.num_blocks == 16
    request = make_request(40, 1)
    plain.admit(request, [])
    compute(plain, request, 40)
    assert len(set(request.block_ids)) == 10 and plain.num_used_blocks == 10


def test_admission_refuses_by_the_window_peak_with_the_null_block_counted() -> None:
    """200 tokens need 50 blocks whole but 5 at once (window 8, chunks <= 8): a pool of 6 takes
    them (5 usable beside the null block), a pool of 5 refuses naming its 4."""
    window = SlidingWindowBlocks(8, BLOCK, 8)
    check_prompt(100, 100, max_seq_len=256, max_blocks=6, block_size=BLOCK, window=window)
    with pytest.raises(AdmissionError, match=r"pool holds \(4\)"):
        check_prompt(100, 100, max_seq_len=256, max_blocks=5, block_size=BLOCK, window=window)
    with pytest.raises(AdmissionError):
        check_prompt(100, 100, max_seq_len=256, max_blocks=6, block_size=BLOCK)
    assert window.max_blocks_held(200) == math.ceil((8 + 8 - 1) / BLOCK) + 1 == 5
    assert window.max_blocks_held(12) == 3


def test_a_prefix_hit_on_blocks_another_request_holds_earns_no_credit() -> None:
    """Window 8, peaks of 5, 8 usable blocks. A's 16-token prompt is computed: blocks 0-1 slid
    out (cached), 2-3 live. B repeats it and hits all four; credited for them it would need
    5 - 4 + 2 = 3 <= 8 - 2 - 3 and run beside A with peaks 5 + 5 > 8 (once A lets go of 2-3
    while B holds them, both may grow to 5). It waits for A instead."""
    prompt = list(range(10, 26))
    a, b = make_request(0, 30, prompt=prompt), make_request(0, 30, prompt=[*prompt, 5])
    scheduler = windowed_scheduler(num_blocks=9)
    engine = FakeEngine(scheduler)
    scheduler.add(a)
    engine.step(), engine.step()
    assert a.num_computed_tokens == 16 and scheduler.kv.num_used_blocks == 2
    scheduler.add(b)
    while a.state is RequestState.RUNNING:
        engine.step()
        assert b.state is RequestState.WAITING
    run(scheduler, [])
    assert [a.output_token_ids, b.output_token_ids] == expected_outputs([a, b])
