"""SpeculationPlanner: how many drafted tokens each decoding request verifies this step.

A draft token is one more row of its request in the packed step. Its worth is the tokens it is
expected to add, p * r^(j-1) for the j-th (p: how often the request's drafts have held their first
token, r: how often a later token held once the one before it had), against what the step budget's
cost model says it adds to the step. A request gets the draft length that most raises the step's
expected tokens per millisecond, and only if that beats the step without it by a margin: a lone
stream (one row, the weights read for one token) speculates deep; a compute-bound batch, whose
every row already earns a token, stops by itself. Drafts never push the predicted step past the
budget's inter-token target, use tokens or logits rows the step no longer has, or run past a
request's max_tokens or the sequence limit. Prefill chunks are chosen before drafts and never give
way to them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from ifb.runtime.request import Request
from ifb.runtime.step_budget.budgets import StepBudget
from ifb.runtime.step_budget.cost_model import StepShape
from ifb.runtime.step_budget.time_correction import StepTimeCorrection

if TYPE_CHECKING:  # the scheduling side loads without torch (tests/unit/test_layering.py)
    from ifb.runtime.engine_format import EngineConfig

logger = logging.getLogger(__name__)

# A draft's expected tokens per ms it adds must beat the step's own tokens per ms by this much.
# At 20% drafts at 16 streams were accepted at 0.79 and still cost 14% more time per step for
# 7.7% more tokens (bench/speculative.py, AVX-512 EPYC, SmolLM2 int8): their learned cost ratio
# sits near break-even there, and the scatter of a loaded machine's steps is wider than the gain.
# A lone stream's drafts earn several times the step's rate (edit: 0.74 acceptance) and open
# chat's about 1.7x (0.35 acceptance, measured 1.01-1.12x over no drafts), so 50% keeps both.
MIN_RATE_GAIN = 0.5
# Acceptance is tracked per request with this decay per verified draft (a window of ~10 drafts),
# from a prior of one accepted and one rejected token: a new request starts at 0.5, for the first
# token and for the run after it. Two rates, not one per-token rate: drafts copied from the prompt
# hold in runs (a quoted passage holds to its end, a wrong guess fails at once), so one rate
# compounded (alpha^j) priced the 8th token of a copy near 0.1 and cut every draft at ~5 tokens.
# Measured over bench/speculative.py's edit prompts (SmolLM2, greedy): first tokens held 0.84, a
# token after a held one 0.94; open chat 0.42 and 0.71. A step without a draft only ages the
# evidence, more slowly, so a request whose drafts stopped paying drifts back toward the prior and
# is tried again now and then (without it one bad draft could leave a rate too low ever to draft
# again; with the fast decay, an always-wrong proposer was retried every other step).
ACCEPTANCE_DECAY = 0.9
IDLE_DECAY = 0.97
IDLE_RATIO_DRIFT = 0.01
_PRIOR_ACCEPTED = 1.0
_PRIOR_TRIED = 2.0


class Proposer(Protocol):
    def prepare(self, target: EngineConfig) -> None:
        """Before the first step, on the executor thread (a draft engine loads and is checked)."""
        ...

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that may follow the request's known tokens; [] for none."""
        ...

    def draft_ms(self, request: Request, num_draft: int) -> float:
        """The predicted time of proposing `num_draft` tokens (a lookup's is ~0)."""
        ...

    def finished(self, request: Request) -> None:
        """A request ended (a cross-request proposer keeps its text)."""
        ...


@dataclass(frozen=True, slots=True)
class DraftRoom:
    """What a step has left for drafts once its decodes and prefill chunks are chosen."""

    decodes: tuple[Request, ...]  # requests decoding one token this step, in step order
    shape: StepShape  # the step as chosen so far
    num_emitting_rows: int  # rows that produce a token this step (decodes, last prompt chunks)
    tokens_left: int  # of max_num_tokens
    logits_rows_left: int  # of the step contract's max_batch_size logits rows
    max_seq_len: int
    has_prompt_chunk: bool = False  # some request prefills more than one prompt token this step


@dataclass(frozen=True, slots=True)
class DraftOdds:
    """A request's chances: its next draft's first token holds with `first`; every later one,
    given the one before held, with `run`."""

    first: float
    run: float

    def expected_extra_tokens(self, num_draft: int) -> float:
        """p + p r + ... + p r^(k-1): the j-th draft counts only if every one before it held."""
        return self.first * sum(self.run**j for j in range(num_draft))


def acceptance_rate(request: Request) -> float:
    """How often the request's drafts have held their first token (decayed, from the prior)."""
    return (request.draft_accepted + _PRIOR_ACCEPTED) / (request.draft_tried + _PRIOR_TRIED)


def draft_odds(request: Request) -> DraftOdds:
    """The request's first-token and run rates (decayed, each from the prior 1 of 2)."""
    run = (request.draft_run_accepted + _PRIOR_ACCEPTED) / (request.draft_run_tried + _PRIOR_TRIED)
    return DraftOdds(acceptance_rate(request), run)


def draft_limit(request: Request, max_draft: int, max_seq_len: int) -> int:
    """Drafts a request may verify: every kept draft and the token after it are outputs."""
    return max(0, min(max_draft, request.max_tokens - request.num_output_tokens - 1, max_seq_len - request.num_tokens))


def with_draft(shape: StepShape, request: Request, num_draft: int) -> StepShape:
    """`shape` with the request's decode row replaced by a chunk of itself and its drafts."""
    start = request.num_computed_tokens
    size = 1 + num_draft
    return replace(
        shape,
        num_decode_rows=shape.num_decode_rows - 1,
        num_decode_context_tokens=shape.num_decode_context_tokens - (start + 1),
        num_prefill_tokens=shape.num_prefill_tokens + size,
        num_prefill_pairs=shape.num_prefill_pairs + StepShape.prefill_pairs(start, size),
    )


def matching_prefix(draft: Sequence[int], tokens: Sequence[int]) -> int:
    """How many leading draft tokens equal `tokens` (the target model's own, position by position)."""
    held = 0
    while held < min(len(draft), len(tokens)) and draft[held] == tokens[held]:
        held += 1
    return held


def _worth(
    budget: StepBudget,
    shape: StepShape,
    request: Request,
    odds: DraftOdds,
    limit: int,
    step_ms: float,
    emitted: float,
    target_ms: float | None,
    ratios: tuple[float, float] = (1.0, 1.0),
    proposer: Proposer | None = None,
) -> int:
    """The draft length (<= limit) that most raises the step's expected tokens per ms, among
    those whose own tokens per added ms beat the step's by MIN_RATE_GAIN, within the target; 0 if
    none. (The draft's own rate, not the step's: against a whole step of 16 rows one draft can
    never move the total by a margin, however cheap it is.) `ratios` turn predictions into what
    this step (as it stands) and a step with drafts measure here (SpeculationPlanner); a
    `proposer`'s own time for the draft (a draft engine's) is added to what the draft costs."""
    now_ratio, drafted_ratio = ratios
    now_ms = step_ms * now_ratio
    base_rate = emitted / now_ms if now_ms > 0 else 0.0
    best, best_rate = 0, base_rate
    for k in range(1, limit + 1):
        predicted = budget.predict_ms(with_draft(shape, request, k))
        if predicted is None or predicted <= 0 or (target_ms is not None and predicted > target_ms):
            break
        gain = odds.expected_extra_tokens(k)
        added_ms = predicted * drafted_ratio - now_ms
        if proposer is not None:
            added_ms += proposer.draft_ms(request, k)
        if added_ms > 0 and gain / added_ms < base_rate * (1 + MIN_RATE_GAIN):
            continue
        rate = (emitted + gain) / (now_ms + max(added_ms, 0.0))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class NoSpeculation:
    """Speculation off: no drafts, nothing observed."""

    def prepare(self, target: EngineConfig) -> None:
        return None

    def plan(self, room: DraftRoom, budget: StepBudget) -> dict[str, tuple[int, ...]]:
        return {}

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None:
        return None

    def observe_step(self, predicted_ms: float, measured_ms: float, has_drafts: bool) -> None:
        return None

    def finished(self, request: Request) -> None:
        return None


class SpeculationPlanner:
    def __init__(self, proposer: Proposer, max_draft: int) -> None:
        self.proposer = proposer
        self.max_draft = max_draft
        # How far decode steps with drafts and without run over the cost model, learned while
        # serving: a draft's rows also pay for sampling and verification, and a step with a chunk
        # runs the context path, which the build-time fit (on long chunks) prices for long chunks.
        # A draft is worth what the step measures with it minus what it measures without.
        self.with_drafts = StepTimeCorrection()
        self.without_drafts = StepTimeCorrection()

    def prepare(self, target: EngineConfig) -> None:
        self.proposer.prepare(target)

    def observe_step(self, predicted_ms: float, measured_ms: float, has_drafts: bool) -> None:
        """A decode step's predicted and measured time (steps with a prompt chunk are not seen).
        Without drafts the drafted ratio drifts toward the plain one (~100 steps), so one slow
        drafted step cannot stop drafting for good."""
        if has_drafts:
            self.with_drafts.observe(predicted_ms, measured_ms)
            return
        self.without_drafts.observe(predicted_ms, measured_ms)
        self.with_drafts.ratio += IDLE_RATIO_DRIFT * (self.without_drafts.ratio - self.with_drafts.ratio)

    def plan(self, room: DraftRoom, budget: StepBudget) -> dict[str, tuple[int, ...]]:
        """request id -> the drafts it verifies this step (only requests that get some).

        Nothing in a step that prefills a prompt chunk: the step budget sized that chunk to fill the
        inter-token target, so a draft there lengthens the longest gaps, and such steps run over
        the cost model by their own ratio (bench/speculative.py, 16 streams: drafts in chunked
        steps cost 14% more time per step for 7.7% more tokens, ITL p99 1.28x)."""
        if room.has_prompt_chunk:
            return {}
        tokens_left, rows_left = room.tokens_left, room.logits_rows_left
        shape = room.shape
        step_ms = budget.predict_ms(shape)
        target_ms = budget.step_target_ms(shape)
        emitted = float(room.num_emitting_rows)
        drafts: dict[str, tuple[int, ...]] = {}
        for request in sorted(room.decodes, key=acceptance_rate, reverse=True):
            limit = min(draft_limit(request, self.max_draft, room.max_seq_len), tokens_left, rows_left)
            if limit <= 0:
                continue
            odds = draft_odds(request)
            ratios = (self.with_drafts.ratio if drafts else self.without_drafts.ratio, self.with_drafts.ratio)
            if step_ms is not None:
                # The longest draft that would pay; none: skip the lookup (or the draft engine).
                limit = _worth(budget, shape, request, odds, limit, step_ms, emitted, target_ms, ratios, self.proposer)
                if not limit:
                    continue
            draft = self.proposer.propose(request, limit)[:limit]
            if step_ms is not None:
                keep = _worth(
                    budget, shape, request, odds, len(draft), step_ms, emitted, target_ms, ratios, self.proposer
                )
                draft = draft[:keep]
            if not draft:
                continue
            drafts[request.request_id] = tuple(draft)
            tokens_left -= len(draft)
            rows_left -= len(draft)
            if step_ms is not None:
                shape = with_draft(shape, request, len(draft))
                step_ms = budget.predict_ms(shape) or step_ms
                emitted += odds.expected_extra_tokens(len(draft))
        return drafts

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """A sampled step: the first `num_accepted` of its `num_draft` draft tokens held (0 of 0:
        no draft, the evidence only ages). The first token was tried if there was a draft; a later
        one only if the one before held, so a rejection counts once, where it happened."""
        decay = ACCEPTANCE_DECAY if num_draft else IDLE_DECAY
        run_tried = min(num_accepted, num_draft - 1) if num_accepted else 0
        request.draft_accepted = request.draft_accepted * decay + (1 if num_accepted else 0)
        request.draft_tried = request.draft_tried * decay + (1 if num_draft else 0)
        request.draft_run_accepted = request.draft_run_accepted * decay + max(0, num_accepted - 1)
        request.draft_run_tried = request.draft_run_tried * decay + run_tried

    def finished(self, request: Request) -> None:
        self.proposer.finished(request)


class Speculation(Protocol):
    """What the scheduler holds: a planner, or NoSpeculation."""

    def prepare(self, target: EngineConfig) -> None: ...

    def plan(self, room: DraftRoom, budget: StepBudget) -> dict[str, tuple[int, ...]]: ...

    def observe(self, request: Request, num_draft: int, num_accepted: int) -> None: ...

    def observe_step(self, predicted_ms: float, measured_ms: float, has_drafts: bool) -> None: ...

    def finished(self, request: Request) -> None: ...


def emitting_rows(num_new_tokens: Sequence[tuple[Request, int]]) -> int:
    """Rows of a chosen step that produce a token: decodes, and the chunks that end a prompt."""
    return sum(1 for request, n in num_new_tokens if request.num_computed_tokens + n == request.num_tokens)
