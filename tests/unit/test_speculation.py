"""Speculative decoding without a model: the proposers' matches, the config, the planner's draft
sizes under a cost model, and the scheduler verifying drafts against FakeEngine (whose next token
is last + 1), where outputs must be what decoding one token at a time gives."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest
from fakes import FakeEngine, expected_outputs, make_request, make_scheduler

from ifb.runtime.errors import LimitExceededError
from ifb.runtime.policies import CapacityPolicyKind
from ifb.runtime.prefix_hash import prefix_block_keys
from ifb.runtime.request import FinishReason, Request, RequestState
from ifb.runtime.runtime_config import RuntimeSettings
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.scheduler import ScheduledBatch, Scheduler
from ifb.runtime.scheduler_stats import SchedulerStats
from ifb.runtime.speculation.config import SpeculativeConfig, SpeculativeMethod, parse_speculative_config
from ifb.runtime.speculation.draft_model import DraftContext, DraftModelProposer
from ifb.runtime.speculation.planner import DraftRoom, SpeculationPlanner, acceptance_rate
from ifb.runtime.speculation.prompt_lookup import PromptLookupProposer
from ifb.runtime.speculation.suffix_cache import SuffixCacheProposer
from ifb.runtime.step_budget.budgets import (
    FixedBudget,
    LatencyTargetBudget,
    RelativeTargetBudget,
    StepBudget,
    step_shape,
)
from ifb.runtime.step_budget.cost_model import StepCostModel

# A lone stream is weight-bound: 10 ms whatever the rows, an extra row almost free.
MEMORY_BOUND = StepCostModel(10.0, 0.05, 0.05, 0.001, 0.0001)
# Every row costs more than a whole decode step is worth: no draft can pay.
COMPUTE_BOUND = StepCostModel(0.1, 5.0, 1.0, 0.0, 0.0)
# In between: a draft pays only for a request whose drafts are usually right.
MIDDLE = StepCostModel(10.0, 1.0, 1.0, 0.0, 0.0)


# -- factories ---------------------------------------------------------------------------------
def with_tokens(tokens: Sequence[int], *, salt: str | None = None, max_tokens: int = 100) -> Request:
    """A request whose known tokens are `tokens` (all prompt)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)
    return make_request(0, max_tokens, prompt=list(tokens), params=params)


def decoding(
    tokens: Sequence[int] | None = None,
    *,
    num_output: int = 3,
    max_tokens: int = 100,
    rate: tuple[float, float] | None = None,
    run_rate: tuple[float, float] | None = None,
) -> Request:
    """A running request decoding its next token: `num_output` outputs, all but the last computed.
    `rate`: (held, tried) of its drafts' first tokens, and of the tokens after them unless
    `run_rate` says otherwise."""
    prompt = list(tokens) if tokens is not None else list(range(100, 120))
    request = make_request(0, max_tokens, prompt=prompt[: len(prompt) - num_output])
    request.token_ids[:] = prompt
    request.num_computed_tokens = request.num_tokens - 1
    request.state = RequestState.RUNNING
    if rate is not None:
        request.draft_accepted, request.draft_tried = rate
        request.draft_run_accepted, request.draft_run_tried = rate
    if run_rate is not None:
        request.draft_run_accepted, request.draft_run_tried = run_rate
    return request


def room(
    requests: Sequence[Request], *, tokens_left: int = 1000, rows_left: int = 1000, max_seq_len: int = 10_000
) -> DraftRoom:
    """A step of decodes only, with what is left of it for drafts."""
    return DraftRoom(
        decodes=tuple(requests),
        shape=step_shape((r, 1) for r in requests),
        num_emitting_rows=len(requests),
        tokens_left=tokens_left,
        logits_rows_left=rows_left,
        max_seq_len=max_seq_len,
    )


def predicted_with(budget: StepBudget, requests: Sequence[Request], drafts: dict[str, tuple[int, ...]]) -> float:
    """The step's predicted time once each request verifies its draft (counted here, not by the planner)."""
    shape = step_shape((r, 1 + len(drafts.get(r.request_id, ()))) for r in requests)
    ms = budget.predict_ms(shape)
    assert ms is not None
    return ms


class Always:
    """Proposes the same long run of tokens whatever it is asked for, and records the asks."""

    def __init__(self, tokens: Sequence[int] = tuple(range(500, 560))) -> None:
        self.tokens = list(tokens)
        self.asked: list[int] = []

    def prepare(self, target: object) -> None:
        return None

    def draft_ms(self, request: Request, num_draft: int) -> float:
        return 0.0

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        self.asked.append(max_tokens)
        return list(self.tokens)

    def finished(self, request: Request) -> None:
        return None


class Garbage(Always):
    """Drafts the fake model never agrees with (it continues prompts of 100 and up by +1)."""

    def __init__(self) -> None:
        super().__init__([5] * 60)


def repetitive_prompt(index: int) -> list[int]:
    """40 distinct tokens, then their first 11 again: the fake continues with the 12th, 13th, ...,
    which prompt lookup finds earlier in the prompt."""
    base = list(range(100 + 50 * index, 140 + 50 * index))
    return base + base[:11]


def trapped_prompt(index: int) -> list[int]:
    """The same, with a second occurrence of base[20:23] followed by 999: lookup drafts 999 after
    it is regenerated, and the fake model rejects that."""
    base = list(range(100 + 50 * index, 140 + 50 * index))
    return base + base[20:23] + [999] + base[:11]


def run(
    speculation: SpeculationPlanner | None,
    max_tokens: Sequence[int],
    *,
    prompts: Callable[[int], list[int]] = repetitive_prompt,
    each_step: Callable[[Scheduler, FakeEngine], None] | None = None,
    setup: Callable[[Scheduler], None] | None = None,
    **scheduler_options: object,
) -> tuple[list[Request], int, Scheduler]:
    """All requests submitted at once and run until idle; FakeEngine checks integrity every step."""
    options: dict[str, object] = {"num_blocks": 256, "max_seq_len": 256, **scheduler_options}
    scheduler = make_scheduler(**options)  # type: ignore[arg-type]
    if speculation is not None:
        scheduler.speculation = speculation
    if setup is not None:
        setup(scheduler)
    engine = FakeEngine(scheduler)
    requests = [make_request(0, n, prompt=prompts(i)) for i, n in enumerate(max_tokens)]
    for request in requests:
        scheduler.add(request)
    steps = 0
    while scheduler.has_work:
        engine.step()
        steps += 1
        if each_step is not None:
            each_step(scheduler, engine)
        assert steps < 10_000, "no progress"
    return requests, steps, scheduler


def lookup() -> SpeculationPlanner:
    return SpeculationPlanner(PromptLookupProposer(1, 3), 4)


# -- prompt lookup -----------------------------------------------------------------------------
def test_prompt_lookup_prefers_the_longest_match_over_a_more_recent_shorter_one() -> None:
    """The last 3 tokens matched at the start beat the last 1 matched just before the tail."""
    tokens = [1, 2, 3, 9, 8, 3, 7, 1, 2, 3]
    assert PromptLookupProposer(1, 3).propose(with_tokens(tokens), 3) == [9, 8, 3]
    assert PromptLookupProposer(1, 1).propose(with_tokens(tokens), 3) == [7, 1, 2]


def test_prompt_lookup_takes_the_most_recent_of_equal_matches() -> None:
    """[1, 2] occurs twice before the tail: the later occurrence's continuation is proposed."""
    tokens = [1, 2, 8, 5, 1, 2, 9, 6, 1, 2]
    assert PromptLookupProposer(2, 2).propose(with_tokens(tokens), 2) == [9, 6]


def test_prompt_lookup_truncates_to_max_tokens_and_to_what_is_there() -> None:
    """At most max_tokens; fewer when the match sits near the end (the continuation may run into the tail)."""
    tokens = [4, 5, 6, 7, 8, 9, 10, 4, 5]
    proposer = PromptLookupProposer(2, 2)
    assert proposer.propose(with_tokens(tokens), 1) == [6]
    assert proposer.propose(with_tokens(tokens), 4) == [6, 7, 8, 9]
    assert proposer.propose(with_tokens(tokens), 100) == [6, 7, 8, 9, 10, 4, 5]
    near_end = [3, 1, 3]
    assert PromptLookupProposer(1, 1).propose(with_tokens(near_end), 5) == [1, 3]


def reference_lookup(tokens: Sequence[int], min_n: int, max_n: int, limit: int) -> list[int]:
    """Prompt lookup by its definition, position by position: the longest n, then the latest start."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        tail = list(tokens[-n:])
        starts = [i for i in range(len(tokens) - n) if list(tokens[i : i + n]) == tail]
        if starts:
            return list(tokens[starts[-1] + n : starts[-1] + n + limit])
    return []


@pytest.mark.parametrize("seed", range(40))
def test_prompt_lookup_equals_the_position_by_position_definition(seed: int) -> None:
    """Random short alphabets (many partial matches of every length) against the definition: the
    bisection over n finds the same longest, latest match as trying every n."""
    rng = random.Random(seed)
    tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 120))]
    for min_n, max_n in [(1, 1), (1, 16), (2, 4), (3, 9)]:
        got = PromptLookupProposer(min_n, max_n).propose(with_tokens(tokens), 7)
        assert got == reference_lookup(tokens, min_n, max_n, 7), (min_n, max_n)


def test_prompt_lookup_respects_min_n() -> None:
    """Only the last token recurs: a match of one is proposed with min_n 1, nothing with min_n 2."""
    tokens = [7, 40, 41, 6, 7]
    assert PromptLookupProposer(1, 3).propose(with_tokens(tokens), 2) == [40, 41]
    assert PromptLookupProposer(2, 3).propose(with_tokens(tokens), 2) == []
    match = PromptLookupProposer(1, 3).match(with_tokens(tokens), 2)
    assert match is not None and match.match_length == 1


def test_prompt_lookup_never_matches_the_tail_itself() -> None:
    """Distinct tokens: the only occurrence of the tail is the tail, so nothing is proposed."""
    assert PromptLookupProposer(1, 4).propose(with_tokens([10, 11, 12, 13]), 3) == []
    assert PromptLookupProposer(1, 4).propose(with_tokens([10]), 3) == []


def test_prompt_lookup_ignores_matches_that_straddle_tokens() -> None:
    """256 is bytes 00 01 00 00 and 0 is 00 00 00 00: [256, 0] holds the bytes of 1 at offset 1.
    That misaligned hit never counts; an aligned 1 further back does."""
    assert PromptLookupProposer(1, 1).propose(with_tokens([256, 0, 7, 1]), 3) == []
    assert PromptLookupProposer(1, 1).propose(with_tokens([1, 9, 256, 0, 5, 1]), 3) == [9, 256, 0]
    # Two tokens: [1, 0] is 01 00 00 00 00 00 00 00, inside [256, 0, 0] at offset 1.
    assert PromptLookupProposer(2, 2).propose(with_tokens([256, 0, 0, 8, 1, 0]), 3) == []
    assert PromptLookupProposer(2, 2).propose(with_tokens([1, 0, 6, 256, 0, 0, 8, 1, 0]), 2) == [6, 256]
    # 0 is four zero bytes: the most recent run of them starts mid-token (byte 5), and the aligned
    # one just before overlaps it (byte 4); the search goes on from inside the misaligned hit.
    assert PromptLookupProposer(1, 1).propose(with_tokens([7, 0, 256, 5, 0]), 3) == [256, 5, 0]


# -- suffix cache ------------------------------------------------------------------------------
def test_suffix_cache_drafts_from_a_finished_request_of_the_same_salt_only() -> None:
    """A finished request's text drafts for a later one of its tenant, never for another tenant."""
    proposer = SuffixCacheProposer(2, 3, 1000)
    proposer.finished(with_tokens(range(10, 30), salt="a"))
    tail = [70, 71, 15, 16]  # no match of its own
    assert proposer.propose(with_tokens(tail, salt="a"), 3) == [17, 18, 19]
    assert proposer.propose(with_tokens(tail, salt="b"), 3) == []
    assert proposer.propose(with_tokens(tail, salt=None), 3) == []
    proposer.finished(with_tokens(range(40, 60), salt=None))
    assert proposer.propose(with_tokens([1, 44, 45], salt=None), 2) == [46, 47]
    assert proposer.propose(with_tokens([1, 44, 45], salt="a"), 2) == []


def test_suffix_cache_prefers_the_own_match_on_equal_length_and_the_longer_shared_one() -> None:
    """Own [15, 16] -> 99 ties a cached [15, 16] -> 17 and wins; a cached [14, 15, 16] is longer."""
    history = [50, 15, 16, 99, 60, 14, 15, 16]
    two = SuffixCacheProposer(1, 2, 1000)
    two.finished(with_tokens([14, 15, 16, 17, 18], salt="t"))
    assert two.propose(with_tokens(history, salt="t"), 2) == [99, 60]
    three = SuffixCacheProposer(1, 3, 1000)
    three.finished(with_tokens([14, 15, 16, 17, 18], salt="t"))
    assert three.propose(with_tokens(history, salt="t"), 2) == [17, 18]


def test_suffix_cache_stays_within_its_token_bound_dropping_the_oldest() -> None:
    """Twenty 12-token requests into a 50-token cache: never over 50; the oldest text is gone, the
    newest still drafts."""
    proposer = SuffixCacheProposer(2, 2, 50)
    for i in range(20):
        proposer.finished(with_tokens(range(1000 + 100 * i, 1012 + 100 * i)))
        assert proposer.num_cached_tokens <= 50
    assert proposer.num_cached_tokens == 48  # the newest four entries
    assert proposer.propose(with_tokens([1, 1000, 1001]), 2) == []
    assert proposer.propose(with_tokens([1, 2900, 2901]), 2) == [2902, 2903]
    assert proposer.propose(with_tokens([1, 2600, 2601]), 2) == [2602, 2603]  # the fourth newest: kept
    assert proposer.propose(with_tokens([1, 2500, 2501]), 2) == []  # the fifth newest: dropped


def test_suffix_cache_keeps_only_the_tail_of_a_request_longer_than_its_bound() -> None:
    proposer = SuffixCacheProposer(2, 2, 50)
    proposer.finished(with_tokens(range(3000, 3070)))
    assert proposer.num_cached_tokens == 50
    assert proposer.propose(with_tokens([1, 3060, 3061]), 2) == [3062, 3063]
    assert proposer.propose(with_tokens([1, 3005, 3006]), 2) == []


def test_suffix_cache_counts_a_refinished_request_once() -> None:
    proposer = SuffixCacheProposer(2, 2, 1000)
    request = with_tokens(range(10, 30))
    proposer.finished(request)
    proposer.finished(request)
    assert proposer.num_cached_tokens == 20
    proposer.finished(with_tokens(range(40, 50)))
    proposer.finished(request)
    assert proposer.num_cached_tokens == 30


# -- config ------------------------------------------------------------------------------------
def test_vllm_speculative_config_keys_are_accepted() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 1}'
    expected = SpeculativeConfig(SpeculativeMethod.NGRAM, 3, 5, 1)
    assert parse_speculative_config(text, SpeculativeConfig()) == expected
    assert RuntimeSettings(speculative_config=text).speculation() == expected
    # The JSON overrides the flags; a JSON without a method turns on ngram, or keeps the flag's.
    settings = RuntimeSettings(speculative="suffix", num_speculative_tokens=7, suffix_cache_tokens=99)
    assert settings.speculation() == SpeculativeConfig(SpeculativeMethod.SUFFIX, 7, suffix_cache_tokens=99)
    assert RuntimeSettings(speculative_config='{"num_speculative_tokens": 2}').speculation().method is (
        SpeculativeMethod.NGRAM
    )
    overridden = RuntimeSettings(speculative="suffix", speculative_config='{"num_speculative_tokens": 2}')
    assert overridden.speculation() == SpeculativeConfig(SpeculativeMethod.SUFFIX, 2)
    assert RuntimeSettings().speculation().enabled is False
    # vLLM's draft model: "model" (our draft engine folder) alone means the draft method.
    draft = SpeculativeConfig(SpeculativeMethod.DRAFT, 3, draft_engine="engines/small")
    assert (
        parse_speculative_config('{"model": "engines/small", "num_speculative_tokens": 3}', SpeculativeConfig())
        == draft
    )
    assert (
        parse_speculative_config(
            '{"method": "draft_model", "model": "engines/small", "num_speculative_tokens": 3}', SpeculativeConfig()
        )
        == draft
    )
    assert (
        RuntimeSettings(speculative="draft", draft_engine="engines/small", num_speculative_tokens=3).speculation()
        == draft
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"method": "ngram", "draft_model": "x"}', "draft_model"),
        ('{"method": "eagle"}', "eagle"),
        ('{"method": ["ngram"]}', "method"),
        ('{"num_speculative_tokens": "3"}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 3.0}', "num_speculative_tokens"),
        ('{"prompt_lookup_max": true}', "prompt_lookup_max"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('["ngram"]', "speculative_config"),
        ('{"method": "ngram"', "speculative_config"),
        ('{"prompt_lookup_max": 1, "prompt_lookup_min": 3}', "prompt_lookup_max"),
        ('{"method": "draft_model"}', "draft_engine"),
        ('{"model": 3}', "model"),
        ('{"method": "ngram", "model": "engines/small"}', "draft_engine"),
    ],
)
def test_bad_speculative_config_is_an_error_naming_the_field(text: str, named: str) -> None:
    with pytest.raises(LimitExceededError, match=named):
        parse_speculative_config(text, SpeculativeConfig())
    with pytest.raises(LimitExceededError, match=named):
        RuntimeSettings(speculative_config=text).speculation()


# -- planner -----------------------------------------------------------------------------------
def test_lone_decode_with_a_repetitive_history_gets_its_lookup_draft() -> None:
    """One weight-bound row: drafting is nearly free, so the lookup's continuation is verified."""
    request = decoding([5, 6, 7, 8, 9, 10, 11, 5, 6, 7])
    drafts = SpeculationPlanner(PromptLookupProposer(1, 3), 4).plan(room([request]), FixedBudget(MEMORY_BOUND))
    assert drafts == {request.request_id: (8, 9, 10, 11)}


def test_no_draft_when_each_row_costs_more_than_the_step_is_worth() -> None:
    """Sixteen decodes whose extra rows each cost several decode steps: no draft, even if proposed."""
    requests = [decoding(rate=(9.0, 10.0)) for _ in range(16)]
    proposer = Always()
    assert SpeculationPlanner(proposer, 4).plan(room(requests), FixedBudget(COMPUTE_BOUND)) == {}
    assert proposer.asked == []  # the lookup is skipped when not even a full draft would pay
    assert SpeculationPlanner(Always(), 4).plan(room(requests[:1]), FixedBudget(MEMORY_BOUND))


@pytest.mark.parametrize("target_ms", [9.0, 10.05, 10.1, 10.2, 10.3, 10.5, 20.0])
def test_drafts_never_push_the_predicted_step_past_the_latency_target(target_ms: float) -> None:
    """Whatever the target, the step with its drafts is predicted within it, and uses it: with
    drafts that usually hold, every token more pays, so one more would cross the target."""
    requests = [decoding(rate=(9.0, 10.0)) for _ in range(2)]
    budget = LatencyTargetBudget(MEMORY_BOUND, target_ms, 4)
    drafts = SpeculationPlanner(Always(), 6).plan(room(requests), budget)
    if drafts:
        assert predicted_with(budget, requests, drafts) <= target_ms
    if target_ms < predicted_with(budget, requests, {}):
        assert drafts == {}
    for request in requests:
        draft = drafts.get(request.request_id, ())
        if len(draft) < 6:
            longer = {**drafts, request.request_id: (*draft, 0)}
            assert predicted_with(budget, requests, longer) > target_ms
    if target_ms >= 20.0:
        assert [len(d) for d in drafts.values()] == [6, 6]


def test_drafts_stay_within_the_relative_target() -> None:
    """RelativeTargetBudget: the target is a multiple of the step's own decode time; a tight
    multiple gives shorter drafts than a loose one, each within its target."""
    requests = [decoding(rate=(9.0, 10.0)) for _ in range(2)]
    plain = MEMORY_BOUND.predict_ms(step_shape((r, 1) for r in requests))
    lengths = []
    for multiple in (1.0, 1.01, 1.02, 2.0):
        budget = RelativeTargetBudget(MEMORY_BOUND, multiple, 4)
        drafts = SpeculationPlanner(Always(), 8).plan(room(requests), budget)
        assert predicted_with(budget, requests, drafts) <= multiple * plain + 1e-9
        lengths.append(sum(len(d) for d in drafts.values()))
    assert lengths[0] == 0 and lengths == sorted(lengths) and lengths[-1] == 16


def test_drafts_never_exceed_the_requests_and_the_steps_limits() -> None:
    """Without a cost model the proposer's run is only cut by the limits: max_tokens (every kept
    draft and the token after it are outputs), max_seq_len, the step's tokens and logits rows."""
    planner = SpeculationPlanner(Always(), 8)
    budget = FixedBudget()
    near_max_tokens = decoding(num_output=3, max_tokens=6)  # 2 more outputs after the next
    assert planner.plan(room([near_max_tokens]), budget) == {near_max_tokens.request_id: (500, 501)}
    at_max_tokens = decoding(num_output=3, max_tokens=4)
    proposer = Always()
    assert SpeculationPlanner(proposer, 8).plan(room([at_max_tokens]), budget) == {}
    assert proposer.asked == []
    near_seq_len = decoding()  # 20 tokens
    assert planner.plan(room([near_seq_len], max_seq_len=23), budget) == {near_seq_len.request_id: (500, 501, 502)}
    requests = [decoding() for _ in range(3)]
    by_tokens = planner.plan(room(requests, tokens_left=11), budget)
    assert [len(d) for d in by_tokens.values()] == [8, 3]
    by_rows = planner.plan(room(requests, rows_left=5), budget)
    assert [len(d) for d in by_rows.values()] == [5]
    assert planner.plan(room(requests, rows_left=0), budget) == {}


def test_low_acceptance_gets_a_shorter_draft_than_high_under_the_same_budget() -> None:
    """The same step, the same proposals: the request whose drafts held gets the longer one."""
    lengths = {}
    for name, rate in [("high", (9.0, 10.0)), ("prior", None), ("low", (0.0, 10.0))]:
        drafts = SpeculationPlanner(Always(), 8).plan(room([decoding(rate=rate)]), FixedBudget(MEMORY_BOUND))
        lengths[name] = sum(len(d) for d in drafts.values())
    assert lengths["high"] > lengths["prior"] > lengths["low"]
    for name, rate in [("high", (9.0, 10.0)), ("low", (0.0, 10.0))]:
        drafts = SpeculationPlanner(Always(), 8).plan(room([decoding(rate=rate)]), FixedBudget(MIDDLE))
        lengths[name] = sum(len(d) for d in drafts.values())
    assert lengths["high"] > 0 and lengths["low"] == 0


def test_drafts_that_hold_in_runs_are_drafted_longer_than_the_same_first_token_odds_alone() -> None:
    """Copying from the prompt holds in runs: two requests whose drafts hold their first token
    equally often, one of which then keeps holding, the other not. The runner gets the longer draft."""
    budget = FixedBudget(StepCostModel(10.0, 0.5, 0.5, 0.0, 0.0))
    lengths = {}
    for name, run_rate in [("runs", (19.0, 20.0)), ("scattered", (3.0, 10.0))]:
        drafts = SpeculationPlanner(Always(), 16).plan(room([decoding(rate=(6.0, 10.0), run_rate=run_rate)]), budget)
        lengths[name] = sum(len(d) for d in drafts.values())
    assert lengths["runs"] > lengths["scattered"] > 0


@pytest.mark.parametrize(
    ("num_draft", "num_accepted", "first", "run"),
    [
        (5, 0, (0, 1), (0, 0)),
        (5, 3, (1, 1), (2, 3)),
        (5, 5, (1, 1), (4, 4)),
        (1, 1, (1, 1), (0, 0)),
        (0, 0, (0, 0), (0, 0)),
    ],
)
def test_a_verified_draft_counts_its_first_token_and_each_later_token_tried_after_a_held_one(
    num_draft: int, num_accepted: int, first: tuple[int, int], run: tuple[int, int]
) -> None:
    """(held, tried): the first token is tried by any draft; a later one only once the one before
    it held, so the tokens after a rejection are not counted as tried."""
    request = decoding()
    SpeculationPlanner(Always(), 8).observe(request, num_draft, num_accepted)
    assert (request.draft_accepted, request.draft_tried) == first
    assert (request.draft_run_accepted, request.draft_run_tried) == run


def test_the_request_with_the_better_rate_is_served_first_when_tokens_are_short() -> None:
    low, high = decoding(rate=(1.0, 10.0)), decoding(rate=(9.0, 10.0))
    drafts = SpeculationPlanner(Always(), 8).plan(room([low, high], tokens_left=3), FixedBudget())
    assert drafts == {high.request_id: (500, 501, 502)}


# -- scheduler with FakeEngine -----------------------------------------------------------------
MAX_TOKENS = (5, 12, 29, 40, 1, 2)


def test_speculative_outputs_equal_one_token_at_a_time_in_fewer_steps() -> None:
    plain, plain_steps, _ = run(None, MAX_TOKENS, prompts=trapped_prompt)
    spec, spec_steps, scheduler = run(lookup(), MAX_TOKENS, prompts=trapped_prompt)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain] == expected_outputs(plain)
    assert all(r.finish_reason is FinishReason.LENGTH for r in spec)
    assert spec_steps < plain_steps
    assert scheduler.stats.spec_num_accepted_tokens > 0
    assert scheduler.stats.spec_num_accepted_tokens < scheduler.stats.spec_num_draft_tokens  # the traps


def test_speculative_steps_respect_the_step_limits_and_leak_no_block() -> None:
    """Each step within max_num_tokens and max_batch_size logits rows, with a KV slot for every
    row it computes, drafts included; a draft's rejected slots go back; every block is free at the
    end (cached ones included: nobody references them)."""

    def check(scheduler: Scheduler, engine: FakeEngine) -> None:
        batch = engine.batches[-1]
        assert batch.num_tokens <= scheduler.config.max_num_tokens
        assert sum(item.num_sample_rows for item in batch.requests) <= scheduler.config.max_batch_size
        for request in scheduler.running:  # at most the next token's block beyond the computed ones
            assert len(request.block_ids) <= scheduler.kv.blocks_for_tokens(request.num_tokens)

    def slots_for_every_row(scheduler: Scheduler) -> None:
        schedule = scheduler.schedule

        def checked() -> ScheduledBatch:
            batch = schedule()
            for item in batch.requests:
                needed = item.request.num_computed_tokens + item.num_new_tokens
                assert len(item.request.block_ids) >= scheduler.kv.blocks_for_tokens(needed), item
            return batch

        scheduler.schedule = checked  # type: ignore[method-assign]

    requests, _, scheduler = run(
        lookup(),
        MAX_TOKENS * 2,
        prompts=trapped_prompt,
        each_step=check,
        setup=slots_for_every_row,
        max_batch_size=6,
        max_num_tokens=24,
    )
    assert scheduler.stats.spec_num_drafts > 0
    scheduler.kv.check_integrity([])
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert all(r.block_ids == [] and r.state is RequestState.FINISHED for r in requests)


def test_speculative_counters_agree_when_every_draft_holds() -> None:
    """Outputs stay inside the prompt's run, so every draft is right: accepted == drafted, and each
    verified draft emits its tokens and one more."""
    max_tokens = (5, 12, 29, 20)
    plain, _, plain_scheduler = run(None, max_tokens)
    _, _, scheduler = run(lookup(), max_tokens)
    stats = scheduler.stats
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_num_emitted_tokens == stats.spec_num_accepted_tokens + stats.spec_num_drafts
    assert stats.generation_tokens == plain_scheduler.stats.generation_tokens == sum(max_tokens)
    assert plain_scheduler.stats.spec_num_drafts == 0


def test_a_wrong_proposer_changes_no_output_and_its_rate_falls() -> None:
    """Garbage drafts: outputs as without speculation, nothing ever accepted, the rate falls from
    the prior 0.5 toward 0 while the drafts keep failing (steps whose tokens went to prefill
    chunks draft nothing)."""
    plain, _, _ = run(None, MAX_TOKENS)
    rates: list[float] = []

    def watch(scheduler: Scheduler, engine: FakeEngine) -> None:
        for request in scheduler.running:
            assert request.draft_accepted == 0.0
            # a rejected draft's slots go back: at most the next token's block past the computed ones
            assert len(request.block_ids) <= scheduler.kv.blocks_for_tokens(request.num_tokens)
            if request.max_tokens == 40:
                rates.append(acceptance_rate(request))

    spec, _, scheduler = run(SpeculationPlanner(Garbage(), 4), MAX_TOKENS, each_step=watch)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert scheduler.stats.spec_num_drafts > 0 and scheduler.stats.spec_num_accepted_tokens == 0
    assert max(r.draft_tried for r in spec) > 5.0  # 1 per rejected draft, decayed by 0.9 a step
    assert rates[0] == 0.5 and rates[-1] < 0.1  # (1 + 0) / (2 + tried)


def test_the_planner_drafts_less_for_a_request_whose_drafts_fail() -> None:
    """With a cost model, garbage drafts pay at first (the prior rate 0.5 buys two tokens) and
    shrink once rejections bring the rate down: later steps draft at most one, most often none."""
    proposer = Garbage()
    drafted: list[int] = []

    def record(scheduler: Scheduler, engine: FakeEngine) -> None:
        drafted.append(sum(len(item.draft_token_ids) for item in engine.batches[-1].requests))

    requests, steps, _ = run(SpeculationPlanner(proposer, 4), (30,), each_step=record, budget=FixedBudget(MIDDLE))
    assert requests[0].output_token_ids == expected_outputs(requests)[0]
    first = next(n for n in drafted if n)
    assert first == 2
    assert max(drafted[-10:]) < first and drafted[-10:].count(0) >= 5
    assert len(proposer.asked) < steps


def test_the_recent_acceptance_rate_follows_a_change_the_lifetime_rate_averages_away() -> None:
    """300 drafts that all failed, then 300 that all held: over the server's life half held; over
    about the last 100 drafts nearly all did: the new drafts carry (1 - 0.99^300) / (1 - 0.99^600)
    of the decayed weight."""
    stats = SchedulerStats()
    for accepted in (0, 4):
        for _ in range(300):
            stats.record_draft(4, accepted, accepted + 1)
    counters = stats.freeze()
    assert counters.spec_num_accepted_tokens / counters.spec_num_draft_tokens == 0.5
    recent = counters.spec_recent_accepted_tokens / counters.spec_recent_draft_tokens
    assert recent == pytest.approx((1 - 0.99**300) / (1 - 0.99**600))
    assert (counters.spec_num_drafts, counters.spec_num_emitted_tokens) == (600, 300 * 1 + 300 * 5)


def test_speculation_publishes_the_same_prefix_blocks() -> None:
    """Only verified tokens are computed: the prefix cache holds the same blocks either way, and a
    follow-up request with a finished one's text hits every full block of it."""
    plain, _, plain_scheduler = run(None, MAX_TOKENS, prompts=trapped_prompt)
    spec, _, scheduler = run(lookup(), MAX_TOKENS, prompts=trapped_prompt)
    assert scheduler.stats.spec_num_accepted_tokens < scheduler.stats.spec_num_draft_tokens
    assert set(scheduler.kv._cached) == set(plain_scheduler.kv._cached)
    for finished in spec:
        follow_up = with_tokens(finished.token_ids + [7])
        hits = scheduler.kv.match_prefix(follow_up)
        assert len(hits) == (finished.num_tokens - 1) // scheduler.kv.block_size
        assert len(hits) == len(plain_scheduler.kv.match_prefix(with_tokens(finished.token_ids + [7])))


def test_a_stop_token_inside_a_verified_draft_ends_the_request_there() -> None:
    """The fake model agrees with the draft 112..115 but 114 is a stop id: output ends at 114, the
    kept drafts after it are not counted as computed, and no block is published whose tokens the
    request never had (publish once hashed the partial last block)."""
    scheduler = make_scheduler(num_blocks=64, max_seq_len=256)
    scheduler.speculation = lookup()
    engine = FakeEngine(scheduler)
    params = SamplingParams(max_tokens=50, stop_token_ids=(114,), ignore_eos=True)
    request = make_request(0, 50, prompt=repetitive_prompt(0), params=params)
    scheduler.add(request)
    engine.run_until_idle()
    assert request.output_token_ids == [111, 112, 113, 114]
    assert request.finish_reason is FinishReason.STOP
    assert any(item.draft_token_ids == (112, 113, 114, 115) for b in engine.batches for item in b.requests)
    assert request.num_computed_tokens <= request.num_tokens
    full_blocks = set(prefix_block_keys(request.token_ids, scheduler.kv.block_size, None))
    assert set(scheduler.kv._cached) <= full_blocks


def test_a_draft_short_of_blocks_is_dropped_not_bought_with_a_preemption() -> None:
    """The pool is full; A's decode fits its last block but its 3-token draft needs one more, and
    B (running, no chunk this step: 3 tokens left cannot end on a block boundary) could be
    preempted for it. The draft is dropped instead and B keeps its blocks."""
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_tokens=4, policy=CapacityPolicyKind.MAX_UTILIZATION)
    scheduler.speculation = lookup()
    a = make_request(0, 20, prompt=list(range(1, 8)) * 2)  # lookup proposes 1, 2, 3
    a.num_prompt_tokens = 12  # the last two are outputs: decoding
    b = make_request(20, 20)
    for request, computed in [(a, 13), (b, 8)]:
        assert scheduler.kv.allocate(request, computed + 1 if request is a else computed)
        request.num_computed_tokens = computed
        request.state = RequestState.RUNNING
        scheduler.running.append(request)
    assert scheduler.kv.num_free_blocks == 0
    planned = SpeculationPlanner(PromptLookupProposer(1, 3), 4).plan(
        room([a], tokens_left=3, rows_left=7), scheduler.step_budget
    )
    assert planned == {a.request_id: (1, 2, 3)}  # what would be verified, had it the blocks
    batch = scheduler.schedule()
    assert [(item.request_id, item.num_new_tokens, item.draft_token_ids) for item in batch.requests] == [
        (a.request_id, 1, ())
    ]
    assert b.state is RequestState.RUNNING and len(b.block_ids) == 2
    assert scheduler.stats.preempted == 0
    scheduler.check_integrity()


class RecordingPlanner(SpeculationPlanner):
    """Prompt lookup that remembers what it planned last."""

    def __init__(self) -> None:
        super().__init__(PromptLookupProposer(1, 3), 4)
        self.last: dict[str, tuple[int, ...]] = {}

    def plan(self, room: DraftRoom, budget: StepBudget) -> dict[str, tuple[int, ...]]:
        self.last = super().plan(room, budget)
        return self.last


def tiny_pool_workload(seed: int) -> tuple[list[list[int]], list[int]]:
    """Six short repetitive prompts whose requests fit 12 blocks one at a time, not together."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(6):
        start, size = rng.randrange(100, 800), rng.randrange(8, 15)
        tokens = list(range(start, start + size))
        prompts.append(tokens + tokens[: rng.randrange(1, size)])
    return prompts, [rng.randrange(4, 13) for _ in prompts]


def test_drafts_never_preempt_under_max_utilization_with_a_tiny_pool() -> None:
    """A draft is optional: with no free block it is dropped, never bought with a preemption.
    Outputs stay what one-token-at-a-time decoding gives while preemption replays prompts."""
    planner = RecordingPlanner()
    dropped = preempted_with_drafts = 0

    def guard(scheduler: Scheduler) -> None:
        drafts = scheduler._drafts

        def checked(chosen: dict[str, tuple[Request, int]]) -> dict[str, tuple[int, ...]]:
            nonlocal dropped
            before = scheduler.stats.preempted
            granted = drafts(chosen)
            assert scheduler.stats.preempted == before, "a draft preempted a request"
            dropped += len(set(planner.last) - set(granted))
            return granted

        scheduler._drafts = checked  # type: ignore[method-assign]

    options = {"num_blocks": 12, "policy": CapacityPolicyKind.MAX_UTILIZATION, "max_num_tokens": 32}
    for seed in range(12):
        prompts, max_tokens = tiny_pool_workload(seed)
        plain, _, _ = run(None, max_tokens, prompts=prompts.__getitem__, **options)
        spec, _, scheduler = run(planner, max_tokens, prompts=prompts.__getitem__, setup=guard, **options)
        assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain] == expected_outputs(plain)
        scheduler.kv.check_integrity([])
        preempted_with_drafts += scheduler.stats.preempted
    assert dropped > 0  # the pool did run short of a draft's blocks
    assert preempted_with_drafts > 0  # and of the requests' own: preemption was exercised


# -- tokens_before_stop ------------------------------------------------------------------------
def test_tokens_before_stop_counts_up_to_and_including_the_stopping_token() -> None:
    scheduler = make_scheduler(max_seq_len=30)
    stop_ids = with_tokens([100] * 10)
    stop_ids.params = SamplingParams(max_tokens=100, stop_token_ids=(7,))
    assert scheduler.tokens_before_stop(stop_ids, [5, 7, 9]) == 2
    assert scheduler.tokens_before_stop(stop_ids, [5, 6, 9]) == 3
    eos = make_request(10, 100, params=SamplingParams(max_tokens=100))
    assert scheduler.tokens_before_stop(eos, [5, 2, 9]) == 2  # fakes.EOS
    ignoring = make_request(10, 100)  # ignore_eos
    assert scheduler.tokens_before_stop(ignoring, [5, 2, 9]) == 3
    late = make_request(10, 100, params=SamplingParams(max_tokens=100, min_tokens=3))
    assert scheduler.tokens_before_stop(late, [2, 2, 2, 2]) == 3
    near_max_tokens = decoding(num_output=3, max_tokens=5)
    assert scheduler.tokens_before_stop(near_max_tokens, [1, 1, 1, 1]) == 2
    near_seq_len = decoding(list(range(100, 128)), num_output=3)  # 28 of 30
    assert scheduler.tokens_before_stop(near_seq_len, [1, 1, 1, 1]) == 2
    assert near_seq_len.num_tokens == 28 and stop_ids.num_tokens == 10  # nothing appended


def test_drafted_steps_measured_slower_than_predicted_shrink_drafts_and_the_drift_undoes_it() -> None:
    """The planner learns how drafted decode steps run against the cost model: when they measure
    well over their prediction (plain ones on it), a request with a middling rate stops drafting;
    plain steps afterwards bring the drafted ratio back, so drafting resumes."""
    request = decoding([5, 6, 7, 8, 9, 10, 11, 5, 6, 7], rate=(1.0, 3.0))
    budget = FixedBudget(MIDDLE)
    planner = SpeculationPlanner(PromptLookupProposer(1, 3), 4)
    assert planner.plan(room([request]), budget)
    for _ in range(20):
        planner.observe_step(11.0, 11.0, has_drafts=False)
        planner.observe_step(12.0, 22.0, has_drafts=True)  # drafted steps take nearly twice the model
    assert planner.plan(room([request]), budget) == {}
    for _ in range(400):
        planner.observe_step(11.0, 11.0, has_drafts=False)
    assert planner.plan(room([request]), budget)


def test_a_draft_engine_keeps_only_the_context_that_matches_the_real_tokens() -> None:
    """The draft engine's context for a request is cut back to the tokens that match the
    request's own (kept drafts stay, the first rejected one and all after it go), and the last
    known token is always computed again: its logits give the first draft."""
    context = DraftContext(fed=[1, 2, 3, 4, 9, 8], num_known=4)  # 9, 8 were drafts
    assert DraftModelProposer._matching(context, [1, 2, 3, 4, 5, 6]) == 4  # 9 rejected
    assert DraftModelProposer._matching(context, [1, 2, 3, 4, 9, 7, 6]) == 5  # 9 kept, 8 rejected
    assert DraftModelProposer._matching(context, [1, 2, 3, 4, 9, 8, 7]) == 6  # both kept
    assert DraftModelProposer._matching(context, [1, 2, 3, 4, 9, 8]) == 5  # the last token anew
    assert DraftModelProposer._matching(DraftContext(), [1, 2, 3]) == 0  # a new request: its prompt
