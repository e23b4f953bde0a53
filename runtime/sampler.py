"""Sampler: per-request parameters applied to one batch of logits, vectorized over rows.

Order: logit bias -> min_tokens EOS mask -> penalties -> reasoning budget's forced close -> guided
bitmask -> temperature -> top-k / top-p / min-p -> sample. Seeded rows draw their noise from their
own generator, so from the same logits a seeded request samples the same tokens whatever else shares
its batch (its logits are batch-invariant on block-quantized engines only; README).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ifb.runtime.guided import apply_bitmask
from ifb.runtime.outputs import TokenLogprob
from ifb.runtime.request import Request
from ifb.runtime.sampling_state import SamplingRow

_NEG_INF = float("-inf")


@dataclass(frozen=True, slots=True)
class RowSample:
    """One row's token, with its logprob entry when the request asked for logprobs."""

    token_id: int
    logprob: TokenLogprob | None


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # log-probability of each sampled token (raw model distribution)
    top_logprobs: list[dict[int, float]] | None

    def rows(self) -> list[RowSample]:
        if self.logprobs is None or self.top_logprobs is None:
            return [RowSample(token, None) for token in self.token_ids]
        return [
            RowSample(token, TokenLogprob(token, logprob, top))
            for token, logprob, top in zip(self.token_ids, self.logprobs, self.top_logprobs, strict=True)
        ]


def _apply_penalties(logits: torch.Tensor, rows: list[int], sampling_rows: Sequence[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for row in rows:
        sampling_row = sampling_rows[row]
        p = sampling_row.request.params
        output = torch.tensor(sampling_row.output_token_ids, dtype=torch.long)
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            seen[torch.tensor(sampling_row.token_ids, dtype=torch.long)] = True
            scores = logits[row]
            penalized = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
            logits[row] = torch.where(seen, penalized, scores)
        if (p.presence_penalty or p.frequency_penalty) and output.numel():
            counts = torch.bincount(output, minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k / top-p / min-p per row (one sort for the whole batch)."""
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ranks = torch.arange(vocab).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    # Only rows that ask for top-p: float32 cumsums pass 1.0 in a long tail, which would cut
    # tokens from a top_p=1 row sharing the batch with one that filters.
    remove |= (cumulative >= top_p[:, None]) & (top_p[:, None] < 1)
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_index, sorted_logits)


def _force_think_closes(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Rows whose reasoning budget is spent take the next token of the closing tag."""
    for index, row in enumerate(rows):
        budget = row.request.params.reasoning_budget
        if budget is None:
            continue
        forced = budget.forced_token(row.output_token_ids)
        if forced is not None:
            logits[index] = _NEG_INF
            logits[index, forced] = 0.0


class Sampler:
    """Turns [R, vocab] logits of R sampling requests into one token each."""

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None
    ) -> SampleResult:
        """`bitmask` (xgrammar's int32 layout) constrains the guided rows; others are untouched."""
        requests = [row.request for row in rows]
        raw_logprobs = logits.log_softmax(dim=-1) if any(r.params.logprobs is not None for r in requests) else None
        raw, logits = logits, logits.clone()
        for row, request in enumerate(requests):
            p = request.params
            if p.logit_bias:
                index = torch.tensor(list(p.logit_bias), dtype=torch.long)
                logits[row, index] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            if rows[row].num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids))
                if banned:
                    logits[row, torch.tensor(sorted(banned), dtype=torch.long)] = _NEG_INF
        penalized = [
            i
            for i, r in enumerate(requests)
            if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
        ]
        _apply_penalties(logits, penalized, rows)
        _force_think_closes(logits, rows)  # before the grammar's mask: a conflict is the grammar's
        if bitmask is not None:
            guided_rows = [i for i, row in enumerate(rows) if row.state.grammar_matcher is not None]
            apply_bitmask(logits, bitmask, guided_rows)
            self._let_the_grammar_win(logits, raw, bitmask, guided_rows)
        tokens = self._choose(logits, rows)
        return self._with_logprobs(tokens, raw_logprobs, requests)

    @staticmethod
    def _let_the_grammar_win(
        logits: torch.Tensor, raw: torch.Tensor, bitmask: torch.Tensor, guided_rows: list[int]
    ) -> None:
        """A guided row left with no token (its grammar allows only tokens that min_tokens or
        stop_token_ids ban, e.g. the end of a finished choice) samples under its grammar alone:
        the constraint outranks min_tokens, rather than the row failing."""
        dead = [row for row in guided_rows if bool(torch.isneginf(logits[row]).all())]
        for row in dead:
            logits[row] = raw[row]
        if dead:
            apply_bitmask(logits, bitmask, dead)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        requests = [row.request for row in rows]
        greedy = torch.tensor([r.params.greedy for r in requests])
        tokens = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return tokens
        temperature = torch.tensor([r.params.temperature or 1.0 for r in requests], dtype=logits.dtype)
        # A masked (-inf) logit stays -inf at any temperature: the division may run as a multiply by
        # the reciprocal, which flushes to 0 past ~1e38 (-inf * 0 = NaN let a disallowed token win).
        scaled = torch.where(torch.isneginf(logits), logits, logits / temperature[:, None])
        top_k = torch.tensor([r.params.top_k for r in requests], dtype=torch.long)
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=logits.dtype)
        min_p = torch.tensor([r.params.min_p for r in requests], dtype=logits.dtype)
        if bool((top_k > 0).any() or (top_p < 1).any() or (min_p > 0).any()):
            scaled = _filter(scaled, top_k, top_p, min_p)
        probs = scaled.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p; per-row noise lets a
        # seeded row use its own generator.
        noise = torch.empty_like(probs).exponential_()
        for index, row in enumerate(rows):
            generator = row.state.generator
            if generator is not None and not row.request.params.greedy:
                noise[index] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=generator)
        sampled = (probs / noise).argmax(dim=-1)
        # A temperature that underflows fp32 (2.2e-309 -> 0) scales logits to +-inf and softmax to
        # NaN; such a row is greedy in the limit, and `tokens` respects the grammar's mask.
        degenerate = ~torch.isfinite(probs).all(dim=-1)
        return torch.where(greedy | degenerate, tokens, sampled)

    @staticmethod
    def _with_logprobs(
        tokens: torch.Tensor, raw_logprobs: torch.Tensor | None, requests: Sequence[Request]
    ) -> SampleResult:
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SampleResult(token_list, None, None)
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        tops: list[dict[int, float]] = []
        for row, request in enumerate(requests):
            values, index = raw_logprobs[row].topk(request.params.logprobs or 0)  # topk(0): {}
            tops.append(dict(zip(index.tolist(), values.tolist(), strict=True)))
        return SampleResult(token_list, chosen, tops)
