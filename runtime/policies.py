"""Scheduling policies: capacity (who may hold KV) and chunking (who gets the token budget).

Each policy is a small class; `make_capacity_policy` / `make_chunking_policy` are the only
places that branch on the enums (worked examples: docs/design.md §6).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Protocol

from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.request import Request


class CapacityPolicyKind(str, Enum):
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"
    MAX_UTILIZATION = "max_utilization"
    STATIC_BATCH = "static_batch"


class ChunkingPolicyKind(str, Enum):
    FIRST_COME_FIRST_SERVED = "fcfs"
    EQUAL_PROGRESS = "equal_progress"


class CapacityPolicy(Protocol):
    def may_admit_now(self, num_running_at_step_start: int) -> bool: ...

    def admission_token_budget(self, budget: int) -> int: ...

    def can_admit(
        self, request: Request, prefix_hits: list[int], first_chunk: int, running: Sequence[Request]
    ) -> bool: ...

    def choose_victim(self, running: Sequence[Request]) -> Request | None: ...


class _AdmitAnyStep:
    """What the in-flight policies share: a request may be seated at any step, and only when it
    can start computing in that step."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def may_admit_now(self, num_running_at_step_start: int) -> bool:
        return True

    def admission_token_budget(self, budget: int) -> int:
        return budget


class GuaranteedNoEvict(_AdmitAnyStep):
    """Admit only if blocks to completion fit beside every admitted request's remaining need."""

    def can_admit(self, request: Request, prefix_hits: list[int], first_chunk: int, running: Sequence[Request]) -> bool:
        reserved = sum(self.kv.blocks_needed_to_completion(r) for r in running)
        return self.kv.blocks_needed_to_admit(request, prefix_hits) <= self.kv.num_free_blocks - reserved

    def choose_victim(self, running: Sequence[Request]) -> Request | None:
        return None  # never preempts; admission reserved every block a request can need


class MaxUtilization(_AdmitAnyStep):
    """Admit while this step's blocks fit; when short, preempt the least-progressed request."""

    def can_admit(self, request: Request, prefix_hits: list[int], first_chunk: int, running: Sequence[Request]) -> bool:
        total = self.kv.blocks_for_tokens(len(prefix_hits) * self.kv.block_size + first_chunk)
        needed = total - len(prefix_hits) + self.kv.num_free_among(prefix_hits)
        return needed <= self.kv.num_free_blocks

    def choose_victim(self, running: Sequence[Request]) -> Request | None:
        """Least computed work (least to recompute); ties go to the newest arrival."""
        if not running:
            return None
        return min(running, key=lambda r: (r.num_computed_tokens, -r.times.arrival))


class StaticBatch(GuaranteedNoEvict):
    """Admit only when nothing runs: the batch drains completely before the next one forms."""

    def may_admit_now(self, num_running_at_step_start: int) -> bool:
        return num_running_at_step_start == 0

    def admission_token_budget(self, budget: int) -> int:
        # The whole batch is seated at once; its prompts are then chunked over the next steps.
        return _UNBOUNDED


_UNBOUNDED = 1 << 40


def make_capacity_policy(kind: CapacityPolicyKind, kv: KVCacheManager) -> CapacityPolicy:
    if kind is CapacityPolicyKind.GUARANTEED_NO_EVICT:
        return GuaranteedNoEvict(kv)
    if kind is CapacityPolicyKind.MAX_UTILIZATION:
        return MaxUtilization(kv)
    return StaticBatch(kv)


def aligned_chunk(request: Request, budget: int, block_size: int) -> int:
    """Tokens of the request's remaining prompt to compute now: the rest if it fits, otherwise
    as many as fit with the chunk ending on a block boundary (0 if none does)."""
    remaining = request.num_tokens_to_compute
    if remaining <= budget:
        return remaining
    end = (request.num_computed_tokens + budget) // block_size * block_size
    return max(0, end - request.num_computed_tokens)


class ChunkingPolicy(Protocol):
    def admission_budget(self, prefilling: Sequence[Request], budget: int, block_size: int) -> int: ...

    def admission_cost(self, first_chunk: int, block_size: int) -> int: ...

    def split(self, prefilling: Sequence[Request], budget: int, block_size: int) -> list[tuple[Request, int]]: ...


class FirstComeFirstServed:
    """Oldest prefill takes as much of the budget as it can use; the next gets the rest."""

    def admission_budget(self, prefilling: Sequence[Request], budget: int, block_size: int) -> int:
        """What running prefills leave over: a new request is admitted only if it can start now."""
        return budget - sum(size for _, size in self.split(prefilling, budget, block_size))

    def admission_cost(self, first_chunk: int, block_size: int) -> int:
        return first_chunk

    def split(self, prefilling: Sequence[Request], budget: int, block_size: int) -> list[tuple[Request, int]]:
        chunks = []
        for request in prefilling:
            size = aligned_chunk(request, budget, block_size)
            if size:
                chunks.append((request, size))
                budget -= size
        return chunks


class EqualProgress:
    """The budget is shared evenly (in whole blocks) so every prefill advances each step."""

    def admission_budget(self, prefilling: Sequence[Request], budget: int, block_size: int) -> int:
        """Everyone shares: a new request may join while each prefill can still get a block."""
        return budget - len(prefilling) * block_size

    def admission_cost(self, first_chunk: int, block_size: int) -> int:
        return min(first_chunk, block_size)

    def split(self, prefilling: Sequence[Request], budget: int, block_size: int) -> list[tuple[Request, int]]:
        sizes = {id(r): 0 for r in prefilling}
        active = list(prefilling)
        while active and budget > 0:
            share = max(block_size, budget // len(active) // block_size * block_size)
            still = []
            for request in active:
                remaining = request.num_tokens_to_compute - sizes[id(request)]
                grant = min(remaining, share, budget)
                if grant < remaining:  # not the last chunk: end on a block boundary
                    start = request.num_computed_tokens + sizes[id(request)]
                    grant = max(0, (start + grant) // block_size * block_size - start)
                sizes[id(request)] += grant
                budget -= grant
                if grant and sizes[id(request)] < request.num_tokens_to_compute:
                    still.append(request)
            if still == active and all(sizes[id(r)] == 0 for r in active):
                break
            active = still
        return [(r, sizes[id(r)]) for r in prefilling if sizes[id(r)]]


def make_chunking_policy(kind: ChunkingPolicyKind) -> ChunkingPolicy:
    if kind is ChunkingPolicyKind.EQUAL_PROGRESS:
        return EqualProgress()
    return FirstComeFirstServed()
