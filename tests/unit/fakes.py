"""Small factories and a fake engine for scheduler tests (no model, no tensors)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.policies import (
    CapacityPolicyKind,
    ChunkingPolicyKind,
    make_capacity_policy,
    make_chunking_policy,
)
from ifb.runtime.request import Request, RequestTimes
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from ifb.runtime.step_budget.budgets import FixedBudget, StepBudget
from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape

_ids = itertools.count()
EOS = 2


def make_request(
    prompt_len: int,
    max_tokens: int,
    *,
    prompt: list[int] | None = None,
    params: SamplingParams | None = None,
    arrival: float | None = None,
) -> Request:
    n = next(_ids)
    tokens = prompt if prompt is not None else [100 + (n * 7 + i) % 50 for i in range(prompt_len)]
    return Request(
        request_id=f"r{n}",
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=params or SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        max_tokens=max_tokens,
        times=RequestTimes(arrival=float(n) if arrival is None else arrival),
        eos_token_ids=frozenset({EOS}),
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_batch_size: int = 8,
    max_num_tokens: int = 32,
    max_seq_len: int = 128,
    policy: CapacityPolicyKind = CapacityPolicyKind.GUARANTEED_NO_EVICT,
    chunking: ChunkingPolicyKind = ChunkingPolicyKind.FIRST_COME_FIRST_SERVED,
    prefix_reuse: bool = True,
    budget: StepBudget | None = None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix_reuse)
    return Scheduler(
        SchedulerConfig(max_batch_size, max_num_tokens, max_seq_len),
        kv,
        make_capacity_policy(policy, kv),
        make_chunking_policy(chunking),
        budget or FixedBudget(),
    )


class FakeEngine:
    """Next token = (last known token + 1) % 1000, never EOS: outputs are predictable.

    Each step's shape is counted here from the requests, independently of the scheduler, into
    `shapes`; with `cost`, the step takes the time that model gives for it, listed in `step_ms`."""

    def __init__(self, scheduler: Scheduler, cost: StepCostModel | None = None) -> None:
        self.scheduler = scheduler
        self.cost = cost
        self.batches: list[ScheduledBatch] = []
        self.shapes: list[StepShape] = []
        self.step_ms: list[float] = []

    def shape(self, batch: ScheduledBatch) -> StepShape:
        """The batch's shape as the engine sees it: one-token slices run on the decode path."""
        prefill = decode_rows = decode_context = pairs = 0
        for item in batch.requests:
            start = item.request.num_computed_tokens
            if item.num_new_tokens == 1:
                decode_rows, decode_context = decode_rows + 1, decode_context + start + 1
            else:
                prefill += item.num_new_tokens
                for position in range(start, start + item.num_new_tokens):
                    pairs += position + 1  # causal: a token reads every key up to its own
        return StepShape(prefill, decode_rows, decode_context, pairs)

    def step(self) -> ScheduledBatch:
        batch = self.scheduler.schedule()
        self.batches.append(batch)
        self.shapes.append(self.shape(batch))
        if self.cost is not None:
            self.step_ms.append(self.cost.predict_ms(self.shapes[-1]))
        sampled = {}
        for item in batch.requests:
            if item.sample:
                sampled[item.request_id] = self.verified(item.request.token_ids[-1], item.draft_token_ids)
        self.scheduler.update(batch, sampled)
        self.scheduler.check_integrity()
        return batch

    @staticmethod
    def next_token(token: int) -> int:
        return (token + 1) % 1000 or 3

    def verified(self, last: int, draft: tuple[int, ...]) -> list[int]:
        """What the model emits for a row and its drafts: the drafts it agrees with, then its own."""
        emitted = []
        for proposed in draft:
            if proposed != self.next_token(last):
                break
            emitted.append(proposed)
            last = proposed
        return [*emitted, self.next_token(last)]

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_work:
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler made no progress"
        return steps


def expected_outputs(requests: Sequence[Request]) -> list[list[int]]:
    """What FakeEngine decodes for each request one token at a time, computed independently."""
    outputs = []
    for request in requests:
        last, out = request.token_ids[request.num_prompt_tokens - 1], []
        for _ in range(request.max_tokens):
            last = FakeEngine.next_token(last)
            out.append(last)
        outputs.append(out)
    return outputs
