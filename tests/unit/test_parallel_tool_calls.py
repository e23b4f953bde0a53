"""`parallel_tool_calls` on /v1/chat/completions: false returns at most one tool call (the first,
as vLLM does), whole or streamed, in each tool-call format; true or absent returns every call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.openai_protocol import ChatCompletionRequest
from ifb.runtime.server.responses import Choice, ResponseShape
from ifb.runtime.server.tool_parsers import ToolCallParserKind, make_tool_call_parser

WEATHER = {"city": "Oslo"}
TIME = {"zone": "CET"}
# Two calls in each family's own format (tool_parsers.py's docstring).
TWO_CALLS = {
    ToolCallParserKind.HERMES: (
        f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}</tool_call>\n'
        f'<tool_call>{{"name": "get_time", "arguments": {json.dumps(TIME)}}}</tool_call>'
    ),
    ToolCallParserKind.LLAMA3_JSON: (
        f'{{"name": "get_weather", "parameters": {json.dumps(WEATHER)}}}; '
        f'{{"name": "get_time", "parameters": {json.dumps(TIME)}}}'
    ),
    ToolCallParserKind.MISTRAL: (
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(WEATHER)}}}, '
        f'{{"name": "get_time", "arguments": {json.dumps(TIME)}}}]'
    ),
}


def chat_request(parallel: bool | None) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "weather and time in Oslo?"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "function": {"name": "get_time"}},
        ],
    }
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return ChatCompletionRequest.model_validate(body)


def shape_for(request: ChatCompletionRequest, kind: ToolCallParserKind) -> ResponseShape:
    return ResponseShape("id", 0, "m", True, str, request.tool_plan(), tool_parser=make_tool_call_parser(kind))


def output(text: str, finished: bool) -> RequestOutput:
    return RequestOutput("r", (1,), text, finished, FinishReason.STOP if finished else None)


def whole_reply_calls(request: ChatCompletionRequest, kind: ToolCallParserKind) -> list[tuple[str, dict]]:
    choice = Choice(0, 0, [1], SamplingParams())
    body = shape_for(request, kind).final_body([choice], [[output(TWO_CALLS[kind], True)]]).model_dump()
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def streamed_calls(request: ChatCompletionRequest, kind: ToolCallParserKind) -> list[tuple[str, dict]]:
    stream = shape_for(request, kind).stream_for(Choice(0, 0, [1], SamplingParams()))
    text = TWO_CALLS[kind]
    pieces = [text[: len(text) // 2], text[len(text) // 2 :], ""]  # a call split across deltas
    chunks = [c for i, piece in enumerate(pieces) for c in stream.chunks(output(piece, i == len(pieces) - 1))]
    events = [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]
    assert "".join(e["delta"].get("content") or "" for e in events) == ""  # no call shows as content
    assert events[-1]["finish_reason"] == "tool_calls"
    calls = [call for e in events for call in e["delta"].get("tool_calls") or []]
    assert [call["index"] for call in calls] == list(range(len(calls)))
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("kind", list(ToolCallParserKind))
@pytest.mark.parametrize("read", [whole_reply_calls, streamed_calls], ids=["whole", "streamed"])
def test_false_returns_the_first_call_only(kind: ToolCallParserKind, read: Any) -> None:
    assert read(chat_request(False), kind) == [("get_weather", WEATHER)]


@pytest.mark.parametrize("parallel", [True, None], ids=["true", "absent"])
@pytest.mark.parametrize("kind", list(ToolCallParserKind))
@pytest.mark.parametrize("read", [whole_reply_calls, streamed_calls], ids=["whole", "streamed"])
def test_true_or_absent_returns_every_call(kind: ToolCallParserKind, read: Any, parallel: bool | None) -> None:
    assert read(chat_request(parallel), kind) == [("get_weather", WEATHER), ("get_time", TIME)]


def test_false_keeps_the_text_around_the_call() -> None:
    """Only further calls go; the reply's own text stays content."""
    request = chat_request(False)
    text = "Checking. " + TWO_CALLS[ToolCallParserKind.HERMES]
    content, calls = request.tool_plan().parse(text, make_tool_call_parser(ToolCallParserKind.HERMES))
    assert content == "Checking." and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_a_non_boolean_is_refused() -> None:
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        chat_request("sometimes")  # type: ignore[arg-type]
