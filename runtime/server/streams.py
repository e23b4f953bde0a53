"""Stream handling for the HTTP routes: the queue timeout on a request's first delta, merging
the deltas of n > 1 choices, collecting them for a non-streaming body, and the SSE event stream.
Closing any of these closes the engine streams under it, which aborts unfinished requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from ifb.runtime.errors import QueueFullError
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.server.responses import Choice, ResponseShape, usage

Stream = AsyncIterator[RequestOutput]
logger = logging.getLogger(__name__)


async def refuse_queue_timeouts(stream: Stream) -> Stream:
    """A request the engine refused for waiting past the queue timeout raises a 429 (before any
    byte is sent); one that was admitted in time streams on, however long its prefill takes."""
    first = await first_delta(stream)
    if first is None:
        return
    if first.timed_out_in_queue:
        raise QueueFullError(first.error or "the request waited longer than the queue timeout")
    yield first
    async for output in stream:
        yield output


async def close_all(streams: list[Stream], pumps: Sequence[asyncio.Task[None]] = ()) -> None:
    """Stop the tasks pumping `streams` (merge's), then close each stream, which aborts its
    request inside the engine unless it finished."""
    for task in pumps:
        task.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]


async def first_delta(stream: Stream) -> RequestOutput | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def collect_all(streams: list[Stream]) -> list[list[RequestOutput]]:
    async def one(stream: Stream) -> list[RequestOutput]:
        return [o async for o in stream]

    try:
        return list(await asyncio.gather(*(one(s) for s in streams)))
    finally:
        await close_all(streams)


async def sse_events(
    shape: ResponseShape,
    choices: list[Choice],
    streams: list[Stream],
    first: list[RequestOutput | None],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The response's events. If shaping the reply fails (a tool-call or reasoning parser
    raises), its client gets an error event and [DONE]; its requests are aborted in the engine."""
    collected: list[list[RequestOutput]] = [[] for _ in choices]
    merged, tasks = merge(streams, first)
    try:
        per_choice = [shape.stream_for(choice) for choice in choices]
        if shape.chat:
            for choice in choices:
                yield shape.role_chunk(choice.index)
        async for i, output in merged:
            collected[i].append(output)
            for chunk in per_choice[i].chunks(output):
                yield chunk
            if output.finish_reason is FinishReason.ERROR:
                yield shape.error_event(output)
        if include_usage:
            yield shape.chunk([], usage=usage(choices, collected))
        yield "data: [DONE]\n\n"
    except Exception as error:  # never a cut connection: the client is told, the server goes on
        logger.exception("streaming response %s failed", shape.response_id)
        yield shape.failure_event(f"shaping the reply failed: {type(error).__name__}: {error}")
        yield "data: [DONE]\n\n"
    finally:  # client gone or done: stop the pumps, which aborts unfinished requests
        await merged.aclose()
        await close_all(streams, tasks)


def merge(
    streams: list[Stream], first: list[RequestOutput | None]
) -> tuple[AsyncGenerator[tuple[int, RequestOutput]], list[asyncio.Task[None]]]:
    """(index, delta) from all streams as they come. One stream (n=1, the common case) is read
    directly; several are pumped into one queue by tasks the caller cancels when done."""
    if len(streams) == 1:

        async def single() -> AsyncGenerator[tuple[int, RequestOutput]]:
            if first[0] is not None:
                yield 0, first[0]
                async for output in streams[0]:
                    yield 0, output

        return single(), []
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    async def pump(i: int, stream: Stream, head: RequestOutput | None) -> None:
        if head is not None:
            await queue.put((i, head))
            async for output in stream:
                await queue.put((i, output))
        await queue.put((i, None))

    async def drain() -> AsyncGenerator[tuple[int, RequestOutput]]:
        remaining = len(streams)
        while remaining:
            i, output = await queue.get()
            if output is None:
                remaining -= 1
            else:
                yield i, output

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, first, strict=True))]
    return drain(), tasks
