"""Sampler: each per-request parameter on hand-made logits, seeded rows independent of the batch, logprobs."""

from __future__ import annotations

import itertools

import pytest
import torch

from ifb.runtime.request import Request, RequestTimes
from ifb.runtime.sampler import Sampler, _filter
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.sampling_state import SamplingRow, SamplingState

VOCAB = 8
EOS = 2
_ids = itertools.count()


def make_request(
    prompt: list[int] | None = None, output: list[int] | None = None, max_tokens: int = 16, **params: object
) -> Request:
    prompt = [5, 6] if prompt is None else prompt
    output = output or []
    return Request(
        request_id=f"s{next(_ids)}",
        token_ids=[*prompt, *output],
        num_prompt_tokens=len(prompt),
        params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        max_tokens=max_tokens,
        times=RequestTimes(arrival=0.0),
        eos_token_ids=frozenset({EOS}),
    )


def row(request: Request, seed: int | None = None) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(request, SamplingState(generator))


def logits_of(*values: float) -> torch.Tensor:
    """One row of logits; missing vocabulary entries are a low -5."""
    out = torch.full((1, VOCAB), -5.0)
    out[0, : len(values)] = torch.tensor(values)
    return out


def draws(request: Request, logits: torch.Tensor, n: int = 300, seed: int = 0) -> set[int]:
    """The distinct tokens `n` seeded draws from one request's row produce."""
    generator = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(request, SamplingState(generator)) for _ in range(n)]
    return set(Sampler().sample(logits.expand(n, -1).clone(), rows).token_ids)


def test_greedy_picks_the_argmax_of_each_row() -> None:
    """temperature=0 returns argmax per row, rows independent of one another."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [9.0, 1.0, 0.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    rows = [row(make_request(temperature=0.0)) for _ in range(3)]
    assert Sampler().sample(logits, rows).token_ids == [2, 0, 3]


def test_top_k_one_equals_greedy_at_any_temperature() -> None:
    """top_k=1 leaves only the argmax, so a hot temperature still returns it, draw after draw."""
    logits = logits_of(0.5, 1.0, 0.9, 0.2, 0.8)
    assert draws(make_request(temperature=2.0, top_k=1), logits) == {1}


def test_unfiltered_sampling_reaches_several_tokens() -> None:
    """Control for the filter tests: without top-k/top-p/min-p several tokens get drawn."""
    logits = logits_of(0.5, 1.0, 0.9, 0.2, 0.8)
    assert len(draws(make_request(temperature=1.0), logits)) >= 4


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    """top_p smaller than the top token's mass still keeps that token (and only it)."""
    logits = logits_of(1.0, 1.1, 1.0, 1.0)
    assert draws(make_request(top_p=0.01), logits) == {1}


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    """min_p=0.5: tokens with p >= 0.5 * p_max survive (here 0 and 1), the rest never come out."""
    # probabilities ~ [0.39, 0.29, 0.14, ...]: 0.29 >= 0.195 survives, 0.14 does not
    logits = logits_of(2.0, 1.7, 1.0, 0.5, 0.5)
    assert draws(make_request(min_p=0.5), logits) == {0, 1}


def test_logit_bias_changes_the_greedy_choice() -> None:
    """A +5 bias on token 3 beats token 0's lead of 2; without the bias token 0 wins."""
    logits = logits_of(3.0, 0.0, 0.0, 1.0)
    plain, biased = make_request(temperature=0.0), make_request(temperature=0.0, logit_bias={3: 5.0})
    assert Sampler().sample(logits.repeat(2, 1), [row(plain), row(biased)]).token_ids == [0, 3]


@pytest.mark.parametrize("num_outputs, expected", [(0, 1), (1, 1), (2, EOS)])
def test_min_tokens_masks_eos_until_reached(num_outputs: int, expected: int) -> None:
    """With min_tokens=2 the EOS (the argmax) is banned for outputs 0 and 1, allowed from the third."""
    request = make_request(output=[4] * num_outputs, temperature=0.0, min_tokens=2)
    assert Sampler().sample(logits_of(0.0, 1.0, 9.0), [row(request)]).token_ids == [expected]


@pytest.mark.parametrize("num_outputs, expected", [(0, 1), (2, 3)])
def test_min_tokens_masks_stop_token_ids_until_reached(num_outputs: int, expected: int) -> None:
    """stop_token_ids are banned like EOS while fewer than min_tokens outputs exist."""
    request = make_request(output=[4] * num_outputs, temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert Sampler().sample(logits_of(0.0, 1.0, 0.0, 9.0), [row(request)]).token_ids == [expected]


def test_min_tokens_leaves_eos_alone_with_ignore_eos() -> None:
    """ignore_eos: EOS is an ordinary token, so min_tokens does not ban it."""
    request = make_request(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert Sampler().sample(logits_of(0.0, 1.0, 9.0), [row(request)]).token_ids == [EOS]


def test_repetition_penalty_moves_the_choice_off_a_seen_token() -> None:
    """Token 0 (in the prompt) leads 2.0 vs 1.5; a penalty of 2 halves it to 1.0 and token 1 wins."""
    logits = logits_of(2.0, 1.5)
    plain = make_request(prompt=[0], temperature=0.0)
    penalized = make_request(prompt=[0], temperature=0.0, repetition_penalty=2.0)
    assert Sampler().sample(logits.repeat(2, 1), [row(plain), row(penalized)]).token_ids == [0, 1]


def test_repetition_penalty_pushes_a_negative_seen_logit_further_down() -> None:
    """A seen token with a negative logit is multiplied (not divided): -1 becomes -3, below -2."""
    logits = logits_of(-1.0, -2.0, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0)
    request = make_request(prompt=[0], temperature=0.0, repetition_penalty=3.0)
    assert Sampler().sample(logits, [row(request)]).token_ids == [1]


def test_presence_penalty_moves_the_choice_off_a_generated_token() -> None:
    """Presence counts generated tokens only: 2.0 - 1.0 for token 0 loses to token 1's 1.5."""
    logits = logits_of(2.0, 1.5)
    in_prompt = make_request(prompt=[0], temperature=0.0, presence_penalty=1.0)
    in_output = make_request(prompt=[5], output=[0], temperature=0.0, presence_penalty=1.0)
    assert Sampler().sample(logits.repeat(2, 1), [row(in_prompt), row(in_output)]).token_ids == [0, 1]


def test_frequency_penalty_scales_with_the_count() -> None:
    """0.3 per occurrence: once (2.0 - 0.3) still wins, three times (2.0 - 0.9) loses to 1.5."""
    logits = logits_of(2.0, 1.5)
    once = make_request(output=[0], temperature=0.0, frequency_penalty=0.3)
    thrice = make_request(output=[0, 0, 0], temperature=0.0, frequency_penalty=0.3)
    assert Sampler().sample(logits.repeat(2, 1), [row(once), row(thrice)]).token_ids == [0, 1]


def _seeded_run(with_others: bool, steps: int = 6) -> list[int]:
    """The tokens a seed-7 request samples over `steps` steps, alone or at row 2 of a 4-row batch."""
    torch.manual_seed(1234 if with_others else 99)  # the unseeded rows' noise differs between runs
    make = torch.Generator().manual_seed(0)
    seeded = make_request(temperature=0.9, top_k=6)
    state = SamplingState(torch.Generator().manual_seed(7))
    others = [
        make_request(temperature=0.0),
        make_request(temperature=1.3, top_p=0.8, repetition_penalty=1.2),
        make_request(temperature=0.7, min_p=0.1, seed=3),
    ]
    other_states = [SamplingState(None), SamplingState(None), SamplingState(torch.Generator().manual_seed(3))]
    tokens = []
    for _ in range(steps):
        seeded_logits = torch.randn(1, VOCAB, generator=make)
        if with_others:
            rows = [SamplingRow(r, s) for r, s in zip(others, other_states, strict=True)]
            rows.insert(2, SamplingRow(seeded, state))
            logits = torch.randn(4, VOCAB)
            logits[2] = seeded_logits[0]
            token = Sampler().sample(logits, rows).token_ids[2]
        else:
            token = Sampler().sample(seeded_logits, [SamplingRow(seeded, state)]).token_ids[0]
        seeded.token_ids.append(token)
        tokens.append(token)
    return tokens


def test_seeded_row_samples_the_same_tokens_whatever_shares_its_batch() -> None:
    """Same seed, same logits: identical tokens alone and beside three other random rows, every step."""
    alone = _seeded_run(with_others=False)
    assert _seeded_run(with_others=True) == alone
    assert len(set(alone)) > 1  # really sampled, not a degenerate argmax


def test_logprobs_are_the_log_softmax_of_the_raw_logits() -> None:
    """Chosen and top logprobs come from the unmodified logits, not the biased/penalized ones."""
    logits = torch.tensor([[3.0, 1.0, 0.5, 0.0, -1.0, -2.0, 0.2, 0.1]])
    request = make_request(temperature=0.0, logprobs=3, logit_bias={4: 50.0})
    result = Sampler().sample(logits, [row(request)])
    expected = logits.log_softmax(dim=-1)[0]
    assert result.token_ids == [4]
    assert result.logprobs == pytest.approx([expected[4].item()])
    assert result.top_logprobs is not None
    assert result.top_logprobs[0] == pytest.approx(
        {0: expected[0].item(), 1: expected[1].item(), 2: expected[2].item()}
    )


def test_top_logprobs_have_n_entries_per_row() -> None:
    """logprobs=n gives n alternatives; logprobs=0 gives none but still the chosen token's logprob."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    rows = [row(make_request(temperature=0.0, logprobs=n)) for n in (5, 0, 1)]
    result = Sampler().sample(logits, rows)
    assert result.top_logprobs is not None and result.logprobs is not None
    assert [len(top) for top in result.top_logprobs] == [5, 0, 1]
    assert len(result.logprobs) == 3


def test_no_logprobs_requested_returns_none() -> None:
    """Without logprobs on any row, neither list is computed."""
    result = Sampler().sample(logits_of(1.0, 2.0), [row(make_request(temperature=0.0))])
    assert result.logprobs is None and result.top_logprobs is None


def test_sampling_does_not_modify_the_callers_logits() -> None:
    """Bias and masks apply to a copy: the engine's logits tensor is unchanged."""
    logits = logits_of(1.0, 2.0, 3.0)
    before = logits.clone()
    request = make_request(temperature=0.0, min_tokens=1, logit_bias={0: 10.0}, repetition_penalty=1.5)
    Sampler().sample(logits, [row(request)])
    assert torch.equal(logits, before)


def test_row_with_filters_off_keeps_every_token_when_the_batch_is_filtered() -> None:
    """top_k=0, top_p=1, min_p=0 beside a top_k row: the unfiltered row's logits pass through unchanged."""
    logits = torch.randn(2, 151_000, generator=torch.Generator().manual_seed(0)) * 3
    filtered = _filter(logits, torch.tensor([0, 5]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert torch.equal(filtered[0], logits[0])


def test_masked_tokens_stay_masked_at_the_largest_temperature() -> None:
    """A -inf logit (a grammar's mask) is never drawn, even at temperature 3.4e38, where a
    reciprocal multiply flushed to zero once turned -inf into NaN and let token 0 win."""
    logits = logits_of(0.5, 1.0, 0.9, 0.2, 0.8)
    logits[0, :3] = float("-inf")
    drawn = draws(make_request(temperature=3.4028235677973366e38), logits)
    assert drawn and drawn <= set(range(3, VOCAB))


def test_a_temperature_that_underflows_is_greedy_within_the_mask() -> None:
    """temperature 2.2e-309 is 0 in fp32: the row takes the (masked) argmax, not a NaN draw."""
    logits = logits_of(0.5, 3.0, 0.9, 0.2, 0.8)
    logits[0, 1] = float("-inf")
    assert draws(make_request(temperature=2.225073858507203e-309), logits) == {2}
