"""Scheduler with a fake engine: policies, chunking, seats, aborts, preemption, random workloads."""

from __future__ import annotations

import random

import pytest
from fakes import FakeEngine, make_request, make_scheduler

from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind
from ifb.runtime.request import FinishReason, RequestState

POLICIES = list(CapacityPolicyKind)


def test_decodes_come_before_prefill_chunks() -> None:
    """A running decode is packed first; a new prompt takes the remaining budget."""
    s = make_scheduler(max_num_tokens=16)
    engine = FakeEngine(s)
    a = make_request(4, 8)
    s.add(a)
    engine.step()  # a's prefill
    b = make_request(40, 4)
    s.add(b)
    batch = engine.step()
    assert [(r.request_id, r.num_new_tokens) for r in batch.requests] == [(a.request_id, 1), (b.request_id, 12)]
    assert b.was_admitted_mid_flight and s.stats.admitted_mid_flight == 1


def test_long_prompt_is_chunked_on_block_boundaries_and_only_last_chunk_samples() -> None:
    """A 30-token prompt under a 12-token budget: chunks 12, 12, 6; one token sampled at the end."""
    s = make_scheduler(max_num_tokens=12, block_size=4)
    engine = FakeEngine(s)
    r = make_request(30, 3)
    s.add(r)
    chunks = [engine.step().requests[0] for _ in range(3)]
    assert [(c.num_new_tokens, c.sample) for c in chunks] == [(12, False), (12, False), (6, True)]
    assert r.num_output_tokens == 1


def test_chunk_end_aligns_to_block_size_when_budget_is_uneven() -> None:
    """With 3 budget tokens left after decodes, a 20-token prompt gets 0 (not a ragged chunk)."""
    s = make_scheduler(max_num_tokens=10, block_size=4)
    engine = FakeEngine(s)
    running = [make_request(1, 10) for _ in range(7)]
    for r in running:
        s.add(r)
    engine.step()
    late = make_request(20, 2)
    s.add(late)
    batch = engine.step()
    sizes = {r.request_id: r.num_new_tokens for r in batch.requests}
    assert late.request_id not in sizes
    assert s.stats.stalls_token_budget >= 1


def test_equal_progress_shares_the_budget() -> None:
    """Two long prompts both advance each step under equal_progress; FCFS serves the first."""
    for chunking, expect_both in [
        (ChunkingPolicyKind.EQUAL_PROGRESS, True),
        (ChunkingPolicyKind.FIRST_COME_FIRST_SERVED, False),
    ]:
        s = make_scheduler(max_num_tokens=16, block_size=4, chunking=chunking)
        engine = FakeEngine(s)
        a, b = make_request(40, 1), make_request(40, 1)
        s.add(a), s.add(b)
        engine.step()  # admission step: FCFS gives a everything
        batch = engine.step()
        ids = {r.request_id for r in batch.requests if r.num_new_tokens > 1}
        assert (ids == {a.request_id, b.request_id}) is expect_both, chunking


def test_guaranteed_no_evict_reserves_blocks_to_completion() -> None:
    """Pool of 10 blocks: a needs 6 to completion, b needs 6 -> b waits until a finishes."""
    s = make_scheduler(num_blocks=10, block_size=4, policy=CapacityPolicyKind.GUARANTEED_NO_EVICT)
    engine = FakeEngine(s)
    a, b = make_request(4, 20), make_request(4, 20)
    s.add(a), s.add(b)
    engine.step()
    assert a.state is RequestState.RUNNING and b.state is RequestState.WAITING
    assert s.stats.stalls_no_capacity >= 1
    engine.run_until_idle()
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert b.times.admitted is not None and s.stats.preempted == 0


def test_max_utilization_admits_both_and_preempts_least_progressed() -> None:
    """Same pool: both admitted; when blocks run out the one with least computed work yields,
    keeps its generated tokens, and finishes later with the same output as alone."""
    s = make_scheduler(num_blocks=10, block_size=4, policy=CapacityPolicyKind.MAX_UTILIZATION)
    engine = FakeEngine(s)
    a, b = make_request(4, 20, arrival=0.0), make_request(4, 20, arrival=1.0)
    s.add(a), s.add(b)
    engine.step()
    assert a.state is RequestState.RUNNING and b.state is RequestState.RUNNING
    engine.run_until_idle()
    assert s.stats.preempted >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert len(a.output_token_ids) == len(b.output_token_ids) == 20
    assert b.output_token_ids == [(b.token_ids[3] + 1 + i) % 1000 for i in range(20)]
    assert s.kv.num_free_blocks == 10


def test_static_batch_admits_only_when_nothing_runs() -> None:
    """A request arriving while a static batch runs waits for the whole batch to drain."""
    s = make_scheduler(policy=CapacityPolicyKind.STATIC_BATCH)
    engine = FakeEngine(s)
    short, long_ = make_request(4, 2), make_request(4, 10)
    s.add(short), s.add(long_)
    engine.step()
    late = make_request(4, 2)
    s.add(late)
    while long_.state is not RequestState.FINISHED:
        engine.step()
        assert late.state is RequestState.WAITING
    engine.run_until_idle()
    assert late.finish_reason is FinishReason.LENGTH and not late.was_admitted_mid_flight


def test_static_batch_seats_the_whole_batch_even_when_prompts_exceed_one_step() -> None:
    """Eight 20-token prompts under a 16-token budget: all eight are seated in the first step
    (prefilled over the next steps); a ninth waits for the batch to drain."""
    s = make_scheduler(policy=CapacityPolicyKind.STATIC_BATCH, max_num_tokens=16, max_batch_size=8)
    engine = FakeEngine(s)
    batch_members = [make_request(20, 3) for _ in range(9)]
    for r in batch_members:
        s.add(r)
    engine.step()
    assert [r.state for r in batch_members[:8]] == [RequestState.RUNNING] * 8
    assert batch_members[8].state is RequestState.WAITING
    engine.run_until_idle()
    assert all(r.finish_reason is FinishReason.LENGTH for r in batch_members)


def test_max_batch_size_limits_seats() -> None:
    s = make_scheduler(max_batch_size=2)
    engine = FakeEngine(s)
    requests = [make_request(4, 3) for _ in range(3)]
    for r in requests:
        s.add(r)
    batch = engine.step()
    assert len(batch.requests) == 2 and requests[2].state is RequestState.WAITING
    assert s.stats.stalls_batch_full >= 1


@pytest.mark.parametrize("when", ["waiting", "prefill", "decode", "preempted"])
def test_abort_in_every_state_frees_blocks(when: str) -> None:
    policy = CapacityPolicyKind.MAX_UTILIZATION if when == "preempted" else CapacityPolicyKind.GUARANTEED_NO_EVICT
    s = make_scheduler(
        num_blocks=10, block_size=4, max_num_tokens=8, policy=policy, max_batch_size=2 if when == "waiting" else 8
    )
    engine = FakeEngine(s)
    blockers = (
        [make_request(4, 20, arrival=-2.0), make_request(4, 20, arrival=-1.0)]
        if when in ("waiting", "preempted")
        else []
    )
    for r in blockers:
        s.add(r)
    target = make_request(20 if when == "prefill" else 4, 20)
    s.add(target)
    engine.step()
    if when == "decode":
        engine.step()
        assert target.is_decoding
    if when == "preempted":
        while target.num_preemptions == 0:
            engine.step()
    expected_state = {
        "waiting": RequestState.WAITING,
        "prefill": RequestState.RUNNING,
        "decode": RequestState.RUNNING,
        "preempted": RequestState.PREEMPTED,
    }[when]
    assert target.state is expected_state
    s.abort(target)
    assert target.finish_reason is FinishReason.ABORT and target.block_ids == []
    s.check_integrity()
    engine.run_until_idle()
    assert s.kv.num_free_blocks == 10 and s.stats.cancelled == 1


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunking", list(ChunkingPolicyKind))
def test_seeded_random_workload_keeps_invariants(policy: CapacityPolicyKind, chunking: ChunkingPolicyKind) -> None:
    """Hundreds of steps of random arrivals, lengths and aborts; integrity after every step
    (FakeEngine checks it), every request finished, every block back in the pool."""
    rng = random.Random(1234)
    s = make_scheduler(
        num_blocks=40,
        block_size=4,
        max_batch_size=6,
        max_num_tokens=24,
        max_seq_len=128,
        policy=policy,
        chunking=chunking,
    )
    engine = FakeEngine(s)
    shared = [rng.randrange(100, 900) for _ in range(16)]
    everyone = []
    for _ in range(400):
        if rng.random() < 0.3:
            prompt = shared[: rng.choice([0, 8, 16])] + [rng.randrange(100, 900) for _ in range(rng.randint(1, 30))]
            r = make_request(0, rng.randint(1, 30), prompt=prompt)
            s.add(r)
            everyone.append(r)
        if everyone and rng.random() < 0.05:
            s.abort(rng.choice(everyone))
        engine.step()
    engine.run_until_idle()
    assert all(r.state is RequestState.FINISHED for r in everyone)
    assert s.kv.num_free_blocks == 40
    finished = [r for r in everyone if r.finish_reason is FinishReason.LENGTH]
    assert finished and all(r.num_output_tokens == r.max_tokens for r in finished)
    if policy is CapacityPolicyKind.MAX_UTILIZATION:
        assert s.stats.preempted > 0
    assert s.kv.prefix_hit_tokens > 0
