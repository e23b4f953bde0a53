"""Verification: which drafted tokens a request keeps, and its seeded generator kept in step.

Each row of a draft samples the target model's own token at that position with the request's
usual sampler (the draft tokens before it taken as given). The draft holds up to the first
position whose sampled token differs; the tokens kept are the sampled ones up to and including
that position — exactly what decoding one token at a time would have produced, because each
position's token is drawn from the same distribution either way. For drafts that are single
guesses (prompt lookup, the suffix cache) this is rejection sampling: a draft token d is kept
with probability p(d), and on a rejection the token emitted is distributed as p without d,
the residual. Greedy requests keep what argmax would have given.

A seeded request draws one noise vector per sampled position from its own generator. Rows past
the first rejection drew noise decoding would not have drawn, so the generator is rewound to
the state after the kept rows' draws: a seeded request gives the same tokens with or without
speculation, whatever the proposer guessed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ifb.runtime.live_request import LiveRequest
from ifb.runtime.outputs import TokenLogprob
from ifb.runtime.sampler import RowSample
from ifb.runtime.scheduler import ScheduledBatch, ScheduledRequest
from ifb.runtime.speculation.planner import matching_prefix


def kept_tokens(draft: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """`sampled` has one token per position (len(draft) + 1): the matching prefix of the draft,
    then the first sampled token that differs (or the one after the whole draft)."""
    return list(sampled[: matching_prefix(draft, sampled) + 1])


class GeneratorRewind:
    """A seeded generator's state before a draft's rows were sampled, to replay only the draws
    of the rows that were kept."""

    def __init__(self, generator: torch.Generator, vocab_size: int) -> None:
        self.generator = generator
        self.vocab_size = vocab_size
        self.state = generator.get_state()

    def keep(self, num_rows: int) -> None:
        """Leave the generator as if only `num_rows` rows had drawn (sampler.py: one Exp(1)
        vector of the vocabulary's size per non-greedy seeded row)."""
        self.generator.set_state(self.state)
        for _ in range(num_rows):
            torch.empty(self.vocab_size, dtype=torch.float32).exponential_(generator=self.generator)


@dataclass(slots=True)
class VerifiedRow:
    """One sampling request's tokens from this step (one, or a verified draft's), with their
    logprob entries; the executor cuts them at a stop with `keep`."""

    live: LiveRequest
    draft: tuple[int, ...]
    tokens: list[int]
    logprobs: list[TokenLogprob | None]

    @property
    def request_id(self) -> str:
        return self.live.request_id

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1 if self.draft else 0

    def keep(self, num_tokens: int) -> None:
        self.tokens = self.tokens[:num_tokens]
        self.logprobs = self.logprobs[:num_tokens]


def seeded_rewinds(
    sampling: Sequence[tuple[LiveRequest, ScheduledRequest]], vocab_size: int
) -> dict[str, GeneratorRewind]:
    """Rewinds for the seeded, sampled requests that verify a draft, taken before sampling."""
    return {
        live.request_id: GeneratorRewind(live.sampling.generator, vocab_size)
        for live, item in sampling
        if item.draft_token_ids and live.sampling.generator is not None and not live.request.params.greedy
    }


def verify_rows(
    sampling: Sequence[tuple[LiveRequest, ScheduledRequest]],
    samples: Sequence[RowSample],
    rewinds: dict[str, GeneratorRewind],
) -> list[VerifiedRow]:
    """Samples come in row order, 1 + len(draft) consecutive rows per request."""
    verified = []
    index = 0
    for live, item in sampling:
        rows = samples[index : index + item.num_sample_rows]
        index += item.num_sample_rows
        tokens = kept_tokens(item.draft_token_ids, [s.token_id for s in rows])
        rewind = rewinds.get(live.request_id)
        if rewind is not None and len(tokens) < len(rows):
            rewind.keep(len(tokens))
        verified.append(VerifiedRow(live, item.draft_token_ids, tokens, [s.logprob for s in rows[: len(tokens)]]))
    return verified


def cut_drafts_by_grammar(batch: ScheduledBatch, live: Mapping[str, LiveRequest]) -> ScheduledBatch:
    """A guided request's draft, cut before the first token its grammar rejects (or the token
    that would complete it: the row after that would have no grammar state to mask with)."""
    items = []
    for item in batch.requests:
        matcher = live[item.request_id].sampling.grammar_matcher if item.draft_token_ids else None
        if matcher is not None and not matcher.is_terminated():
            allowed = _grammar_allows(matcher, item.draft_token_ids)
            cut = len(item.draft_token_ids) - allowed
            item = replace(
                item, num_new_tokens=item.num_new_tokens - cut, draft_token_ids=item.draft_token_ids[:allowed]
            )
        items.append(item)
    return replace(batch, requests=tuple(items))


def _grammar_allows(matcher: Any, draft: Sequence[int]) -> int:
    """How many leading draft tokens the matcher accepts without completing; it is left as found."""
    accepted = 0
    for token in draft:
        if not matcher.accept_token(token):
            break
        accepted += 1
        if matcher.is_terminated():  # the completing token is not allowed: no row after it to mask
            matcher.rollback(accepted)
            return accepted - 1
    if accepted:
        matcher.rollback(accepted)
    return accepted
