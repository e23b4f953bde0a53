"""OpenAI response shaping: completion and chat bodies, stream chunks, logprobs, reasoning, tool calls
and usage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ifb.runtime.outputs import RequestOutput, TokenLogprob
from ifb.runtime.reasoning import NoReasoning, ReasoningParser, ReasoningStream, split_reasoning
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server import openai_responses as wire
from ifb.runtime.server.tool_parsers import CallHoldBack, CallMarkers, HermesToolParser, ToolCallParser
from ifb.runtime.server.tools import ToolPlan

TokenText = Callable[[int], str]


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a response: its index, which prompt it answers, and its parameters."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What every body and chunk of one response shares."""

    response_id: str
    created: int
    model: str
    chat: bool
    token_text: TokenText
    tools: ToolPlan | None = None
    reasoning: ReasoningParser = NoReasoning()
    prompt_tail: str = ""  # the chat prompt's end, as text (only for a parser that reads it)
    tool_parser: ToolCallParser = HermesToolParser()  # reads `auto` calls in the model family's format

    def chunk(self, choices: list[Any], usage: wire.Usage | None = None) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(wire.Chunk(**self._head(kind), choices=choices, usage=usage))

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.model}

    def role_chunk(self, index: int) -> str:
        return self.chunk([wire.RoleChunkChoice(index=index, delta=wire.Delta(role="assistant", content=""))])

    def error_event(self, output: RequestOutput) -> str:
        """A request that failed mid-stream: its client gets this event, not a silent stop."""
        return self.failure_event(output.error or "request failed")

    def failure_event(self, message: str) -> str:
        error = wire.ErrorInfo(message=message, type="server_error", code="request_failed")
        return sse(wire.ErrorBody(error=error), exclude_unset=True)  # no `param` key

    def stream_for(self, choice: Choice) -> ChoiceStream:
        calls = self.tools.hold_back(self.tool_parser) if self.tools is not None else CallHoldBack(CallMarkers())
        return ChoiceStream(self, choice, self.reasoning_stream(choice), calls)

    def reasoning_stream(self, choice: Choice) -> ReasoningStream:
        return self.reasoning.stream(self.prompt_tail, guided=choice.params.guided is not None)

    def completion_logprobs(self, choice: Choice, outputs: list[RequestOutput]) -> wire.CompletionLogprobs | None:
        if not (entries := _entries(choice, outputs)):
            return None
        return wire.CompletionLogprobs(
            tokens=[self.token_text(e.token_id) for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[{self.token_text(t): v for t, v in e.top.items()} for e in entries],
        )

    def chat_logprobs(self, choice: Choice, outputs: list[RequestOutput]) -> wire.ChatLogprobs | None:
        """OpenAI's chat logprobs: token text, its UTF-8 bytes, and the top alternatives."""
        if not (entries := _entries(choice, outputs)):
            return None
        return wire.ChatLogprobs(
            content=[
                wire.ChatTokenLogprob(
                    **self._token(e.token_id),
                    logprob=e.logprob,
                    top_logprobs=[wire.TopLogprob(**self._token(t), logprob=v) for t, v in e.top.items()],
                )
                for e in entries
            ]
        )

    def _token(self, token_id: int) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "bytes": list(text.encode("utf-8"))}

    def final_body(self, choices: list[Choice], results: list[list[RequestOutput]]) -> wire.CompletionBody:
        bodies = [self._final_choice(choice, outputs) for choice, outputs in zip(choices, results, strict=True)]
        kind = "chat.completion" if self.chat else "text_completion"
        return wire.CompletionBody(**self._head(kind), choices=bodies, usage=usage(choices, results))

    def _final_choice(self, choice: Choice, outputs: list[RequestOutput]) -> wire.CompletionChoice | wire.ChatChoice:
        text = "".join(o.new_text for o in outputs)
        reason = outputs[-1].finish_reason.value if outputs and outputs[-1].finish_reason else None
        if not self.chat:
            logprobs = self.completion_logprobs(choice, outputs)
            return wire.CompletionChoice(index=choice.index, text=text, finish_reason=reason, logprobs=logprobs)
        split = split_reasoning(self.reasoning_stream(choice), text)  # tool calls come from the content only
        content, calls = self.tools.parse(split.content, self.tool_parser) if self.tools else (split.content, [])
        message = wire.ChatMessage(
            content=(content or None) if split.reasoning else content,
            reasoning_content=split.reasoning or None,
            tool_calls=[wire.ToolCall.model_validate(c) for c in calls] or None,
        )
        reason = "tool_calls" if calls else reason
        return wire.ChatChoice(
            index=choice.index, message=message, finish_reason=reason, logprobs=self.chat_logprobs(choice, outputs)
        )


@dataclass(slots=True)
class ChoiceStream:
    """Turns one choice's deltas into SSE chunks. Reasoning is split off first (`reasoning`
    holds back a tag split across deltas); with tools, content that may be (part of) a tool call
    is held back (`calls`): from where the tool-call parser sees one open in `auto` mode, the
    whole reply when a call is forced."""

    shape: ResponseShape
    choice: Choice
    reasoning: ReasoningStream
    calls: CallHoldBack

    def chunks(self, output: RequestOutput) -> list[str]:
        reason = output.finish_reason.value if output.finished and output.finish_reason else None
        index = self.choice.index
        if not self.shape.chat:
            logprobs = self.shape.completion_logprobs(self.choice, [output])
            body = wire.CompletionChoice(index=index, text=output.new_text, finish_reason=reason, logprobs=logprobs)
            return [self.shape.chunk([body])]
        split = self.reasoning.feed(output.new_text)
        if output.finished:
            split += self.reasoning.finish()
        visible = self.calls.feed(split.content)
        chat_logprobs = self.shape.chat_logprobs(self.choice, [output])
        out = []
        if visible or split.reasoning or chat_logprobs is not None or not output.finished:
            content = visible or (None if output.finished or split.reasoning else "")
            delta = wire.Delta(reasoning_content=split.reasoning or None, content=content)
            out.append(self._chunk(delta, None, chat_logprobs))
        if output.finished:
            out.append(self._final_chunk(reason))
        return out

    def _final_chunk(self, reason: str | None) -> str:
        tools = self.shape.tools
        if tools is None or tools.mode == "none":
            return self._chunk(wire.Delta(), reason, None)
        content, calls = tools.parse(self.calls.finish(), self.shape.tool_parser)  # calls, or text after all
        tool_calls = [wire.ToolCallDelta.model_validate({"index": i, **call}) for i, call in enumerate(calls)]
        delta = wire.Delta(tool_calls=tool_calls or None, content=content or None)
        return self._chunk(delta, "tool_calls" if calls else reason, None)

    def _chunk(self, delta: wire.Delta, reason: str | None, logprobs: wire.ChatLogprobs | None) -> str:
        choice = wire.ChatChunkChoice(index=self.choice.index, delta=delta, finish_reason=reason, logprobs=logprobs)
        return self.shape.chunk([choice])


def sse(record: BaseModel, exclude_unset: bool = False) -> str:
    # pydantic-core writes the JSON itself (compact, UTF-8): 1.9 us against 4.7 for model_dump then
    # json.dumps, the larger part of a chunk's 10.6 us (bench/sse_chunk.py).
    return f"data: {record.model_dump_json(exclude_unset=exclude_unset)}\n\n"


def _entries(choice: Choice, outputs: list[RequestOutput]) -> list[TokenLogprob]:
    """The logprobs to send: none unless the request asked for them."""
    return [lp for o in outputs for lp in o.logprobs] if choice.params.logprobs is not None else []


def usage(choices: list[Choice], results: list[list[RequestOutput]]) -> wire.Usage:
    """Each prompt counts once, however many choices (n) answer it."""
    prompts = {c.prompt_index: len(c.prompt_token_ids) for c in choices}
    prompt_tokens = sum(prompts.values())
    completion = sum(r[-1].num_output_tokens for r in results if r)
    return wire.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion
    )


def first_error(results: list[list[RequestOutput]]) -> str | None:
    """The error of the first choice that failed (finish reason `error`), if any."""
    for outputs in results:
        if outputs and outputs[-1].finish_reason is FinishReason.ERROR:
            return outputs[-1].error or "request failed"
    return None
