"""Anthropic Messages replies: the message body and its streamed events, shaped from the
engine's deltas with the same reasoning split and tool-call parsing as the OpenAI chat route
(responses.py's ResponseShape and ChoiceStream parts)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from ifb.runtime.outputs import RequestOutput
from ifb.runtime.reasoning import split_reasoning
from ifb.runtime.request import FinishReason
from ifb.runtime.server.responses import Choice, ChoiceStream, ResponseShape
from ifb.runtime.server.streams import Stream

logger = logging.getLogger(__name__)

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens the prefix cache held


class MessageBody(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: Usage


class ErrorInfo(BaseModel):
    type: str
    message: str


class ErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: ErrorInfo


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped call (tools.py) as a tool_use block; its arguments parsed back to an object."""
    function = call["function"]
    tool_id = "toolu_" + call["id"].removeprefix("call_")
    return {"type": "tool_use", "id": tool_id, "name": function["name"], "input": json.loads(function["arguments"])}


def stop_reason(output: RequestOutput, calls: bool, stop_sequence: str | None) -> StopReason:
    if calls:
        return "tool_use"
    if output.finish_reason is FinishReason.LENGTH:
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def matched_stop(full_text: str, stops: tuple[str, ...]) -> str | None:
    """Which stop sequence ended a reply, from the text of all its tokens: the earliest one in it
    (the engine cut the reply there, so none occurs before; of two at one place, the first given)."""
    found = [(index, order) for order, stop in enumerate(stops) if (index := full_text.find(stop)) != -1]
    return stops[min(found)[1]] if found else None


def usage(prompt: list[int], last: RequestOutput) -> Usage:
    return Usage(
        input_tokens=len(prompt), output_tokens=last.num_output_tokens, cache_read_input_tokens=last.num_cached_tokens
    )


def message_body(
    shape: ResponseShape, choice: Choice, outputs: list[RequestOutput], stop_sequence: str | None
) -> MessageBody:
    """The whole reply: a thinking block (reasoning), a text block (content), tool_use blocks."""
    text = "".join(o.new_text for o in outputs)
    split = split_reasoning(shape.reasoning_stream(choice), text)
    tools = shape.tools
    content, calls = tools.parse(split.content, shape.tool_parser) if tools else (split.content, [])
    blocks: list[dict[str, Any]] = []
    if split.reasoning:
        blocks.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [tool_use_block(call) for call in calls]
    last = outputs[-1]
    return MessageBody(
        id=shape.response_id,
        model=shape.model,
        content=blocks,
        stop_reason=stop_reason(last, bool(calls), stop_sequence),
        stop_sequence=None if calls else stop_sequence,
        usage=usage(choice.prompt_token_ids, last),
    )


def event(record: dict[str, Any] | BaseModel) -> str:
    """One SSE event, named by its `type` as Anthropic's stream names them."""
    data = record.model_dump_json() if isinstance(record, BaseModel) else json.dumps(record, ensure_ascii=False)
    kind = record.type if isinstance(record, BaseModel) else record["type"]  # type: ignore[attr-defined]
    return f"event: {kind}\ndata: {data}\n\n"


@dataclass(slots=True)
class BlockStream:
    """The content blocks of one streamed reply: opens a block when its kind of text first
    comes, closes it when another kind starts; reasoning is split off and tool calls held back
    exactly as the OpenAI chat stream does (`parts`)."""

    parts: ChoiceStream
    index: int = -1
    open_kind: str | None = None
    events: list[str] = field(default_factory=list)

    def feed(self, output: RequestOutput) -> list[str]:
        split = self.parts.reasoning.feed(output.new_text)
        if output.finished:
            split += self.parts.reasoning.finish()
        if split.reasoning:
            self._delta("thinking", {"type": "thinking_delta", "thinking": split.reasoning})
        visible = self.parts.calls.feed(split.content)
        if visible:
            self._delta("text", {"type": "text_delta", "text": visible})
        return self.take()

    def finish(self) -> bool:
        """Close the reply: text held back as a possible call, then each call as a tool_use
        block with its whole input as one input_json_delta. Whether any call was made."""
        shape = self.parts.shape
        tools = shape.tools
        held = self.parts.calls.finish()
        content, calls = tools.parse(held, shape.tool_parser) if tools is not None else (held, [])
        if content:
            self._delta("text", {"type": "text_delta", "text": content})
        for call in calls:
            block = tool_use_block(call)
            self._open("tool_use", {**block, "input": {}})
            self._delta("tool_use", {"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        self._close()
        return bool(calls)

    def take(self) -> list[str]:
        """The events made since the last take."""
        out, self.events = self.events, []
        return out

    def _delta(self, kind: str, delta: dict[str, Any]) -> None:
        if self.open_kind != kind:  # a tool_use block is opened by finish(), with its id and name
            self._open(kind, _EMPTY_BLOCKS[kind])
        self.events.append(event(_delta_event(self.index, delta)))

    def _open(self, kind: str, block: dict[str, Any]) -> None:
        self._close()
        self.index += 1
        self.open_kind = kind
        self.events.append(event({"type": "content_block_start", "index": self.index, "content_block": block}))

    def _close(self) -> None:
        if self.open_kind is None:
            return
        if self.open_kind == "thinking":  # clients that check it see a (blank) signature
            self.events.append(event(_delta_event(self.index, {"type": "signature_delta", "signature": ""})))
        self.events.append(event({"type": "content_block_stop", "index": self.index}))
        self.open_kind = None


_EMPTY_BLOCKS = {
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
    "text": {"type": "text", "text": ""},
}


def _delta_event(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


async def message_events(
    shape: ResponseShape,
    choice: Choice,
    stream: Stream,
    first: RequestOutput | None,
    find_stop: Callable[[list[RequestOutput]], Awaitable[str | None]],
) -> AsyncIterator[str]:
    """Anthropic's event sequence for one reply: message_start, a ping, the blocks' start / delta
    / stop events, message_delta (stop reason, usage), message_stop. A failure in the engine or
    in shaping sends an `error` event (the HTTP status is already 200). `find_stop`: which stop
    sequence ended the reply (matched_stop, after detokenizing it off the loop)."""
    blocks = BlockStream(shape.stream_for(choice))
    start = MessageBody(
        id=shape.response_id,
        model=shape.model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=Usage(input_tokens=len(choice.prompt_token_ids), output_tokens=0),
    )
    yield event({"type": "message_start", "message": start.model_dump()})
    yield event({"type": "ping"})
    outputs: list[RequestOutput] = []
    try:
        pending = [first] if first is not None else []
        async for output in _chain(pending, stream):
            outputs.append(output)
            if output.finish_reason is FinishReason.ERROR:
                yield error_event("api_error", output.error or "request failed")
                return
            for line in blocks.feed(output):
                yield line
        if not outputs:
            yield error_event("api_error", "the request ended without output")
            return
        calls = blocks.finish()
        for line in blocks.take():
            yield line
        stop_sequence = None if calls else await find_stop(outputs)
        last = outputs[-1]
        delta = {"stop_reason": stop_reason(last, calls, stop_sequence), "stop_sequence": stop_sequence}
        yield event(
            {"type": "message_delta", "delta": delta, "usage": usage(choice.prompt_token_ids, last).model_dump()}
        )
        yield event({"type": "message_stop"})
    except Exception as error:  # never a cut connection: the client is told, the server goes on
        logger.exception("streaming message %s failed", shape.response_id)
        yield error_event("api_error", f"shaping the reply failed: {type(error).__name__}: {error}")
    finally:  # client gone or done: closing the stream aborts an unfinished request
        await stream.aclose()  # type: ignore[attr-defined]


async def _chain(head: list[RequestOutput], stream: Stream) -> AsyncIterator[RequestOutput]:
    for output in head:
        yield output
    async for output in stream:
        yield output


def error_event(kind: str, message: str) -> str:
    return event(ErrorBody(error=ErrorInfo(type=kind, message=message)))
