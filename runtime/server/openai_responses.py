"""OpenAI-compatible response bodies and stream chunks (pydantic), as the server sends them.
Field order is wire order; `None` in a field made by `omitted()` leaves the key out, any other
`None` is sent as `null`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


def omitted() -> Any:
    return Field(default=None, exclude_if=lambda value: value is None)


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Indexed(BaseModel):
    index: int


class ToolCallDelta(ToolCall, _Indexed):
    """A tool call in a stream chunk: its index first, then the call."""


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    """A choice of a completions body, and of a `text_completion` stream chunk."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = omitted()  # vLLM's field: the <think> part (--reasoning-parser)
    tool_calls: list[ToolCall] | None = omitted()


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class Delta(BaseModel):
    role: Literal["assistant"] | None = omitted()
    reasoning_content: str | None = omitted()
    tool_calls: list[ToolCallDelta] | None = omitted()
    content: str | None = omitted()


class RoleChunkChoice(BaseModel):
    """The first chunk of a chat choice: its role, and no logprobs key."""

    index: int
    delta: Delta
    finish_reason: str | None = None


class ChatChunkChoice(RoleChunkChoice):
    logprobs: ChatLogprobs | None


class _Envelope(BaseModel):
    id: str
    object: str
    created: int
    model: str


class CompletionBody(_Envelope):
    """The body of a non-streaming /v1/completions or /v1/chat/completions response."""

    choices: list[CompletionChoice] | list[ChatChoice]
    usage: Usage


class Chunk(_Envelope):
    """One SSE event of a stream; the usage chunk (include_usage) has no choices."""

    choices: list[CompletionChoice | ChatChunkChoice | RoleChunkChoice]
    usage: Usage | None = omitted()


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None  # left unset (out of the JSON, with exclude_unset) in the stream's error event
    code: str


class ErrorBody(BaseModel):
    error: ErrorInfo
