"""Reasoning budget: which token a reply must take next (the closing tag once the think block holds
the budget's tokens), the sampler forcing it in greedy, sampled and draft-verifying rows, the
grammar outranking it, and the errors that name the field."""

from __future__ import annotations

import pytest
import torch
from test_sampler import logits_of, make_request, row

from ifb.runtime.errors import AdmissionError
from ifb.runtime.reasoning import ReasoningParserKind, make_reasoning_parser
from ifb.runtime.reasoning_budget import ReasoningBudget
from ifb.runtime.sampler import Sampler
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.sampling_state import SamplingRow

OPEN, CLOSE = 6, 7  # one-token tags, as in Qwen3's and DeepSeek-R1's vocabularies
SPELLED_OPEN, SPELLED_CLOSE = (1, 3, 4), (1, 5, 3, 4)  # a tokenizer that spells the tags in pieces


def budget(
    tokens: int, inside: bool, open_ids: tuple[int, ...] = (OPEN,), close_ids: tuple[int, ...] = (CLOSE,)
) -> ReasoningBudget:
    return ReasoningBudget(tokens, inside).with_tags(open_ids, close_ids)


@pytest.mark.parametrize(
    ("spent", "reply", "forced"),
    [
        (budget(3, inside=True), [], None),
        (budget(3, inside=True), [0, 1], None),
        (budget(3, inside=True), [0, 1, 2], CLOSE),  # three reasoning tokens: the block closes now
        (budget(3, inside=True), [0, 1, CLOSE], None),  # closed in time by the model
        (budget(3, inside=True), [0, 1, 2, CLOSE, 0, 1, 2, 3], None),  # the answer is free
        (budget(0, inside=True), [], CLOSE),  # no thinking at all
        (budget(2, inside=False), [0, 1, 2, 3], None),  # a reply that opens no block
        (budget(2, inside=False), [OPEN, 0], None),
        (budget(2, inside=False), [OPEN, 0, 1], CLOSE),  # the open tag itself is not counted
        (budget(2, inside=False), [0, OPEN, 0, 1], None),  # a block opens with the reply or never
        (budget(0, inside=False), [OPEN], CLOSE),
    ],
)
def test_the_close_is_forced_once_the_block_holds_the_budget(
    spent: ReasoningBudget, reply: list[int], forced: int | None
) -> None:
    assert spent.forced_token(reply) == forced


def test_a_spelled_close_is_forced_piece_by_piece_and_then_left_alone() -> None:
    spelled = budget(2, inside=False, open_ids=SPELLED_OPEN, close_ids=SPELLED_CLOSE)
    reply = [*SPELLED_OPEN, 0, 2]
    for piece in SPELLED_CLOSE:
        assert spelled.forced_token(reply) == piece
        reply.append(piece)
    assert spelled.forced_token(reply) is None
    assert spelled.forced_token([*SPELLED_OPEN[:2]]) is None  # not open yet (nor known to be)


def test_without_its_tags_a_budget_forces_nothing() -> None:
    """SamplingParams made by hand carry none; the frontend fills them in before the engine sees them."""
    assert ReasoningBudget(0, starts_inside=True).forced_token([0, 1, 2]) is None


def sample(logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None = None) -> list[int]:
    return Sampler().sample(logits, rows, bitmask).token_ids


def test_the_sampler_forces_the_close_in_greedy_and_sampled_rows_alike() -> None:
    spent = budget(2, inside=True)
    logits = logits_of(0.0, 9.0, 1.0).expand(3, -1).clone()
    rows = [
        row(make_request(output=[0, 1], temperature=0.0, reasoning_budget=spent)),
        row(make_request(output=[0, 1], temperature=1.0, reasoning_budget=spent), seed=3),
        row(make_request(output=[0], temperature=0.0, reasoning_budget=spent)),  # one token left
    ]
    assert sample(logits, rows) == [CLOSE, CLOSE, 1]


def test_a_row_verifying_drafts_counts_them_as_the_reply() -> None:
    """Speculation samples each draft position as if the drafts before it were kept."""
    request = make_request(output=[0], temperature=0.0, reasoning_budget=budget(2, inside=True))
    rows = [SamplingRow(request, row(request).state, pending=()), SamplingRow(request, row(request).state, (1,))]
    assert sample(logits_of(0.0, 9.0).expand(2, -1).clone(), rows) == [1, CLOSE]


def test_a_grammar_that_forbids_the_close_outranks_the_budget() -> None:
    """A constrained reply keeps its constraint (the row samples under the grammar alone)."""
    request = make_request(output=[0, 1], temperature=0.0, reasoning_budget=budget(2, inside=True))
    state = row(request).state
    state.grammar_matcher = object()  # type: ignore[assignment]  # marks the row guided; the mask decides
    bitmask = torch.tensor([[1 << 3]], dtype=torch.int32)  # xgrammar's layout: only token 3 allowed
    assert sample(logits_of(0.0, 9.0), [SamplingRow(request, state)], bitmask) == [3]


def test_a_negative_budget_is_refused_naming_the_field() -> None:
    with pytest.raises(AdmissionError) as error:
        SamplingParams(reasoning_budget=ReasoningBudget(-1, starts_inside=True))
    assert error.value.field == "max_reasoning_tokens"


@pytest.mark.parametrize(
    ("kind", "tail", "guided", "inside"),
    [
        (None, "<think>", False, None),  # no parser: no budget (the server refuses one)
        (ReasoningParserKind.QWEN3, "<|assistant|><think>\n", False, True),
        (ReasoningParserKind.QWEN3, "<|assistant|><think></think>", False, False),
        (ReasoningParserKind.QWEN3, "<|assistant|><think>", True, False),  # a grammar decides
        (ReasoningParserKind.DEEPSEEK_R1, "", False, True),
    ],
)
def test_where_a_reply_starts_is_the_reasoning_parsers_call(
    kind: ReasoningParserKind | None, tail: str, guided: bool, inside: bool | None
) -> None:
    assert make_reasoning_parser(kind).starts_inside(tail, guided) is inside
