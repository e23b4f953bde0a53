"""OutputProcessor: turns each sampled token into text and decides the stops only text and
grammars can see (stop strings, a finished or violated constraint), *before* the scheduler's
update, so a request is finished in exactly one place (Scheduler.update)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ifb.runtime.detokenizer import IncrementalDetokenizer
from ifb.runtime.live_request import LiveRequest
from ifb.runtime.outputs import RequestOutput, TokenLogprob
from ifb.runtime.request import FinishReason, Request, Stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TextStop:
    """A stop text or a grammar decided at a request's `num_tokens`-th new token of this step."""

    num_tokens: int
    stop: Stop


class OutputProcessor:
    """Advances each live request's detokenizer and reads (never owns) its grammar matcher."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def detokenizer(self, request: Request) -> IncrementalDetokenizer:
        """A new request's detokenizer (its LiveRequest holds it)."""
        params = request.params
        return IncrementalDetokenizer(self._tokenizer, request.token_ids, params.stop, params.skip_special_tokens)

    def process(self, sampled: Iterable[tuple[LiveRequest, Sequence[int]]]) -> dict[str, TextStop]:
        """Detokenize and advance the grammar for each request's new tokens, in order; the stops
        they imply. A stop at one token drops the tokens after it (a verified draft gives several):
        `TextStop.num_tokens` says how many the request keeps. A request whose detokenizer, stop
        strings or grammar raise stops there with `error`; the others go on."""
        stops: dict[str, TextStop] = {}
        for live, tokens in sampled:
            for index, token in enumerate(tokens):
                try:
                    stop = self._push(live, token)
                except Exception as error:  # this request's text or grammar, not the step's
                    logger.exception("output processing of %s failed at token %d", live.request_id, token)
                    stop = Stop(FinishReason.ERROR, f"turning token {token} into output failed: {_named(error)}")
                if stop is not None:
                    stops[live.request_id] = TextStop(index + 1, stop)
                    break
        return stops

    @staticmethod
    def _push(live: LiveRequest, token: int) -> Stop | None:
        detok = live.detokenizer
        if live.request.params.skip_special_tokens or not _ends_request(live.request, token):
            detok.push([token])  # a finishing EOS or stop id is not text, even with special tokens shown
        stop = Stop(FinishReason.STOP) if detok.stopped else None
        matcher = live.sampling.grammar_matcher
        if matcher is None or matcher.is_terminated():
            return stop
        if not matcher.accept_token(token):  # the mask forbids this: an internal fault, said so
            return Stop(FinishReason.ERROR, f"sampled token {token} is not allowed by the request's constraint")
        if matcher.is_terminated():
            return stop or Stop(FinishReason.STOP)  # the constraint is complete
        return stop

    def token_output(
        self, live: LiveRequest, tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None]
    ) -> RequestOutput:
        return self._output(live, tuple(tokens), tuple(lp for lp in logprobs if lp is not None))

    def final_output(self, live: LiveRequest) -> RequestOutput:
        """The end of a request that finished outside a token (abort, error, shutdown)."""
        return self._output(live, (), ())

    @staticmethod
    def failed_output(request: Request) -> RequestOutput:
        """The end of a request that failed before it had a detokenizer (its setup raised)."""
        return _delta(request, "", (), ())

    @staticmethod
    def _output(live: LiveRequest, new_token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]) -> RequestOutput:
        return _delta(live.request, live.detokenizer.take(live.request.state.is_finished), new_token_ids, logprobs)


def _delta(
    request: Request, new_text: str, new_token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]
) -> RequestOutput:
    """One delta; a finished request's carries its end (only a request that never got a token
    can have timed out in the queue, so a token's delta always says False there)."""
    final = request.state.is_finished
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        new_text=new_text,
        finished=final,
        finish_reason=request.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_prefix_hit_tokens,
        error=request.error,
        timed_out_in_queue=request.timed_out_in_queue,
        **(_timings(request) if final else {}),
    )


def _ends_request(request: Request, token: int) -> bool:
    """Whether `token` is one that stops `request` (the executor cut its tokens after any such)."""
    params = request.params
    return token in params.stop_token_ids or (not params.ignore_eos and token in request.eos_token_ids)


def _named(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _timings(request: Request) -> dict[str, float | None]:
    t = request.times
    end = t.finished or time.perf_counter()
    return {
        "ttft_s": None if t.first_token is None else t.first_token - t.arrival,
        "e2e_s": end - t.arrival,
        "queue_s": None if t.admitted is None else t.admitted - t.arrival,
    }
