"""Scheduler: each iteration decides who runs and with how many tokens; never touches tensors.

schedule() -> ScheduledBatch (decodes first, then prefill chunks, then admissions, then any
speculative drafts the step can afford); update(batch, tokens) appends sampled tokens (several
for a verified draft), applies token-level stops, publishes full blocks to the prefix cache (and
frees those slid out of a window: kv.advance) and frees finished requests. Collaborators come
in through the constructor, so a fake engine can drive it in tests.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.policies import CapacityPolicy, ChunkingPolicy, aligned_chunk
from ifb.runtime.request import FinishReason, Request, RequestState, Stop
from ifb.runtime.scheduler_stats import SchedulerStats
from ifb.runtime.speculation.planner import DraftRoom, NoSpeculation, Speculation, emitting_rows, matching_prefix
from ifb.runtime.step_budget.budgets import StepBudget, deepest_start, step_shape
from ifb.runtime.step_budget.first_token import PendingPrompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    # Logits rows a step may ask for: the engine's baked max_batch_size (the step contract's
    # num_logits bound), which a runtime max_batch_size below it leaves room in for drafts.
    max_num_logits: int | None = None

    @property
    def logits_rows(self) -> int:
        return self.max_num_logits or self.max_batch_size


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's part of a step. With `draft_token_ids` (speculation) it computes its next
    token and the drafts after it, and samples at each of those 1 + len(draft) positions."""

    request: Request
    num_new_tokens: int  # drafts included
    sample: bool
    draft_token_ids: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def step_token_ids(self) -> list[int]:
        """The tokens this step computes: the request's next known ones, then the drafts."""
        start = self.request.num_computed_tokens
        known = self.request.token_ids[start : start + self.num_new_tokens - len(self.draft_token_ids)]
        return [*known, *self.draft_token_ids]

    @property
    def num_prompt_chunk_tokens(self) -> int:
        """Tokens of a prompt chunk (more than one): the rows a prefill counts, drafts aside."""
        n = self.num_new_tokens - len(self.draft_token_ids)
        return n if n > 1 else 0

    @property
    def num_sample_rows(self) -> int:
        return 1 + len(self.draft_token_ids) if self.sample else 0


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    requests: tuple[ScheduledRequest, ...]
    predicted_ms: float | None = None  # the step budget's cost model, when it has one

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def has_prefill_chunk(self) -> bool:
        """Whether some request takes more than one prompt token: the steps a step budget sizes."""
        return any(r.num_prompt_chunk_tokens for r in self.requests)

    @property
    def has_drafts(self) -> bool:
        return any(r.draft_token_ids for r in self.requests)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        capacity: CapacityPolicy,
        chunking: ChunkingPolicy,
        step_budget: StepBudget,
        clock: Callable[[], float] = time.perf_counter,
        speculation: Speculation | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.capacity = capacity
        self.chunking = chunking
        self.step_budget = step_budget
        self.speculation: Speculation = speculation or NoSpeculation()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._clock = clock

    # -- inbox ------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.stats.submitted += 1

    def abort(self, request: Request) -> bool:
        """Finish a request the caller gave up on; False if it had finished already."""
        if request.state.is_finished:
            return False
        self.finish(request, FinishReason.ABORT)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- schedule -----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        num_running_at_start = len(self.running)
        budget = self.config.max_num_tokens
        chosen: dict[str, tuple[Request, int]] = {}  # by request id, in step order
        for request in [r for r in self.running if r.num_tokens_to_compute == 1]:
            if request.state is not RequestState.RUNNING:
                continue  # preempted earlier in this loop
            if self._reserve(request, 1, chosen):
                chosen[request.request_id] = (request, 1)
                budget -= 1
        prefilling = [r for r in self.running if r.num_tokens_to_compute > 1]
        decodes = step_shape(chosen.values())
        pending = self._pending_prompts(prefilling)
        prefill_budget = self.step_budget.prefill_token_budget(budget, decodes, deepest_start(prefilling), pending)
        if self.capacity.may_admit_now(num_running_at_start):
            admission_budget = self.capacity.admission_token_budget(
                self.chunking.admission_budget(prefilling, prefill_budget, self.kv.block_size)
            )
            prefilling += self._admit(admission_budget, num_running_at_start)
        elif self.waiting:
            self.stats.stalls_batch_full += 1
        # A prefix hit can start an admitted prompt deeper than any running one: bound again.
        prefill_budget = min(
            prefill_budget,
            self.step_budget.prefill_token_budget(budget, decodes, deepest_start(prefilling), pending),
        )
        for request, size in self.chunking.split(prefilling, prefill_budget, self.kv.block_size):
            if request.state is RequestState.RUNNING and self._reserve(request, size, chosen):
                chosen[request.request_id] = (request, size)
        drafts = self._drafts(chosen)
        batch = tuple(
            ScheduledRequest(r, n + len(draft), r.num_computed_tokens + n == r.num_tokens, draft)
            for r, n in chosen.values()
            for draft in [drafts.get(r.request_id, ())]
        )
        shape = step_shape((item.request, item.num_new_tokens) for item in batch)
        return ScheduledBatch(batch, self.step_budget.predict_ms(shape))

    def _pending_prompts(self, prefilling: Sequence[Request]) -> list[PendingPrompt]:
        """The prompts this step's prefill could serve, in the order it serves them: those
        running, then those waiting that free seats would admit. A preempted request recomputing
        its context has had its first token: it counts as backlog ahead, with no deadline."""
        seats = self.config.max_batch_size - len(self.running)
        queue = [*prefilling, *islice(self.waiting, max(0, seats))]
        if not queue:
            return []
        now = self._clock()
        return [
            PendingPrompt(
                None if r.times.first_token is not None else 1000.0 * (now - r.times.arrival),
                r.num_tokens - r.num_computed_tokens,
            )
            for r in queue
        ]

    def _drafts(self, chosen: dict[str, tuple[Request, int]]) -> dict[str, tuple[int, ...]]:
        """The speculative drafts this step verifies, by request id, each with its KV slots
        allocated; a draft never preempts anyone (it is optional: without blocks it is dropped)."""
        decodes = tuple(r for r, n in chosen.values() if n == 1 and r.is_decoding)
        if not decodes:
            return {}
        emitting = emitting_rows(list(chosen.values()))
        room = DraftRoom(
            decodes=decodes,
            shape=step_shape(chosen.values()),
            num_emitting_rows=emitting,
            tokens_left=self.config.max_num_tokens - sum(n for _, n in chosen.values()),
            logits_rows_left=self.config.logits_rows - emitting,
            max_seq_len=self.config.max_seq_len,
            has_prompt_chunk=any(n > 1 for _, n in chosen.values()),
        )
        planned = self.speculation.plan(room, self.step_budget)
        return {
            request_id: draft
            for request_id, draft in planned.items()
            if self.kv.allocate(chosen[request_id][0], 1 + len(draft))
        }

    def _reserve(self, request: Request, num_tokens: int, chosen: dict[str, tuple[Request, int]]) -> bool:
        """Allocate blocks for this step, preempting (policy permitting) until they fit."""
        while not self.kv.allocate(request, num_tokens):
            victims = [r for r in self.running if r.request_id not in chosen]
            victim = self.capacity.choose_victim(victims)
            if victim is None:
                self.stats.stalls_no_capacity += 1
                return False
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.state = RequestState.PREEMPTED
        request.num_preemptions += 1
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.stats.preempted += 1
        logger.debug("preempted %s", request.request_id)

    def _admit(self, budget: int, num_running_at_start: int) -> list[Request]:
        """Seat waiting requests (FCFS, head-of-line) while seats, tokens and capacity allow.

        Blocks are allocated afterwards, for the chunk each admitted request actually gets.
        """
        admitted: list[Request] = []
        while self.waiting:
            if len(self.running) >= self.config.max_batch_size:
                self.stats.stalls_batch_full += 1
                break
            request = self.waiting[0]
            hits = self.kv.match_prefix(request)
            request.num_computed_tokens = len(hits) * self.kv.block_size
            first_chunk = aligned_chunk(request, budget, self.kv.block_size)
            if first_chunk == 0 or not self.capacity.can_admit(request, hits, first_chunk, self.running):
                request.num_computed_tokens = 0
                if first_chunk == 0:
                    self.stats.stalls_token_budget += 1
                else:
                    self.stats.stalls_no_capacity += 1
                break
            self.waiting.popleft()
            self.kv.admit(request, hits)
            self._mark_running(request, num_running_at_start)
            admitted.append(request)
            budget -= self.chunking.admission_cost(first_chunk, self.kv.block_size)
        return admitted

    def _mark_running(self, request: Request, num_running_at_start: int) -> None:
        now = self._clock()
        if request.state is RequestState.WAITING:
            request.times.admitted = now
            self.stats.record_queue_latency(now - request.times.arrival)
            if num_running_at_start > 0:
                request.was_admitted_mid_flight = True
                self.stats.admitted_mid_flight += 1
        request.state = RequestState.RUNNING
        self.running.append(request)

    # -- update -------------------------------------------------------------------------------
    def update(
        self, batch: ScheduledBatch, sampled: Mapping[str, Sequence[int]], stops: Mapping[str, Stop] | None = None
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish stopped requests: token stops
        (eos, stop ids, max_tokens, max_seq_len) and `stops` decided from text and grammars by
        the output processor (a stop there ends the request at its last token given). The one
        place a running request is finished after a step.

        A sampling row gives one token, a verified draft its kept drafts and the token after
        them (executor: speculation/verification.py); tokens after a token stop are dropped.
        Only verified tokens ever count as computed, so no unverified token is published to the
        prefix cache, and blocks that held only rejected drafts go back to the pool.

        Returns the requests that produced a token this step (finished ones included).
        """
        stops = stops or {}
        now = self._clock()
        produced = []
        self.stats.num_steps += 1
        for item in batch.requests:
            request = item.request
            if request.state is not RequestState.RUNNING:
                continue  # aborted while the step ran
            tokens = sampled[item.request_id] if item.sample else ()
            # Computed: the step's tokens before its drafts, and the drafts that were kept (all
            # given tokens but the last, which is the next one to compute).
            kept_drafts = max(0, len(tokens) - 1) if item.draft_token_ids else 0
            request.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids) + kept_drafts
            if request.num_computed_tokens <= request.num_prompt_tokens:
                self.stats.prompt_tokens += item.num_new_tokens
            if not item.sample:
                self.kv.advance(request)
                continue
            self._count_draft(request, item.draft_token_ids, tokens)
            produced.append(request)
            if request.times.first_token is None:
                request.times.first_token = now
            request.times.last_token = now
            reason = self._append(request, tokens)
            # A token stop inside a verified draft drops the kept drafts after it: no longer known
            # tokens, they must not count as computed (publish would hash a partial block).
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
            stop = stops.get(item.request_id)
            if stop is not None:
                self.finish(request, stop.reason, stop.error)
            elif reason is not None:
                self.finish(request, reason)
            else:
                if item.draft_token_ids:
                    self.kv.release_beyond(request, request.num_tokens)
                self.kv.advance(request)
        return produced

    def _append(self, request: Request, tokens: Iterable[int]) -> FinishReason | None:
        """Append tokens up to the first that stops the request; that token's reason."""
        for token in tokens:
            request.token_ids.append(token)
            self.stats.generation_tokens += 1
            reason = self._stops_at(request, token, request.num_output_tokens, request.num_tokens)
            if reason is not None:
                return reason
        return None

    def _count_draft(self, request: Request, draft: Sequence[int], tokens: Sequence[int]) -> None:
        """Every sampled step tells the speculation how its draft fared (none is news too: old
        evidence decays, so a request whose drafts failed is tried again later)."""
        accepted = matching_prefix(draft, tokens)
        self.speculation.observe(request, len(draft), accepted)
        if draft:
            self.stats.record_draft(len(draft), accepted, len(tokens))

    def tokens_before_stop(self, request: Request, tokens: Sequence[int]) -> int:
        """How many of `tokens` the request would append before a token stop ends it (the
        stopping token included): what the output processor may turn into text."""
        count = request.num_output_tokens
        for index, token in enumerate(tokens):
            count += 1
            if self._stops_at(request, token, count, request.num_prompt_tokens + count) is not None:
                return index + 1
        return len(tokens)

    def observe_step(self, batch: ScheduledBatch, measured_ms: float) -> None:
        """The measured time of a step this scheduler predicted: the step budget and the
        speculation planner learn from it."""
        if batch.predicted_ms is not None:
            self.step_budget.observe_step(batch.predicted_ms, measured_ms, batch.has_prefill_chunk)
            if not batch.has_prefill_chunk:
                self.speculation.observe_step(batch.predicted_ms, measured_ms, batch.has_drafts)

    def _stops_at(self, request: Request, token: int, num_output: int, num_tokens: int) -> FinishReason | None:
        """The reason `token` stops the request once it holds `num_output` outputs, `num_tokens` in all."""
        params = request.params
        if num_output >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP
        if num_output >= request.max_tokens or num_tokens >= self.config.max_seq_len:
            return FinishReason.LENGTH
        return None

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request in any state, the one way any request ends; its blocks go back to the
        pool now."""
        if request.state.is_finished:
            return
        if request.state is RequestState.RUNNING:
            self.running.remove(request)
            self.kv.publish(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.error = error
        request.times.finished = self._clock()
        self.speculation.finished(request)
        if request.timed_out_in_queue:
            self.stats.refused += 1
        elif reason is FinishReason.ABORT:
            self.stats.cancelled += 1
        elif reason is FinishReason.ERROR:
            self.stats.failed += 1
        else:
            self.stats.completed += 1

    def expire_waiting(self, arrived_before: float) -> list[Request]:
        """Refuse requests still waiting for their first admission that arrived before
        `arrived_before` (the queue timeout); preempted ones were admitted once and stay."""
        expired = [r for r in self.waiting if r.state is RequestState.WAITING and r.times.arrival < arrived_before]
        for request in expired:
            request.timed_out_in_queue = True
            self.finish(request, FinishReason.ABORT, "the request was not admitted within the queue timeout")
        return expired

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.running)
        for request in self.waiting:
            assert not request.block_ids, f"waiting request {request.request_id} holds blocks"
