"""Messages from the executor to callers: per-step deltas and the final completion."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from ifb.runtime.request import FinishReason


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request gained in one step (streamed), or its end."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    timed_out_in_queue: bool = False


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """A finished request, as returned by LLM.generate."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[TokenLogprob, ...] | None
    num_cached_tokens: int
    ttft_s: float | None
    e2e_s: float | None
    error: str | None = None

    @classmethod
    def collect(cls, prompt_token_ids: list[int], deltas: list[RequestOutput], want_logprobs: bool) -> CompletionOutput:
        last = deltas[-1]
        assert last.finished and last.finish_reason is not None
        return cls(
            request_id=last.request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            text="".join(d.new_text for d in deltas),
            token_ids=tuple(t for d in deltas for t in d.new_token_ids),
            finish_reason=last.finish_reason,
            logprobs=tuple(lp for d in deltas for lp in d.logprobs) if want_logprobs else None,
            num_cached_tokens=last.num_cached_tokens,
            ttft_s=last.ttft_s,
            e2e_s=last.e2e_s,
            error=last.error,
        )


async def until_final(
    inbox: asyncio.Queue[RequestOutput], abandoned: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """One request's deltas from `inbox`, up to its final one; a consumer that closes or cancels
    the iterator before then calls `abandoned` (which aborts the request)."""
    finished = False
    try:
        while not finished:
            output = await inbox.get()
            finished = output.finished
            yield output
    finally:
        if not finished:
            abandoned()
