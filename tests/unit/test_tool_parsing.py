"""Tool calls in a model's text (`auto`), and the stream that holds them back from content."""

from __future__ import annotations

import json

from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.responses import Choice, ResponseShape
from ifb.runtime.server.tool_parsers import HermesToolParser, ParsedCall
from ifb.runtime.server.tools import FunctionDefinition, Tool, plan_tools

NAMES = {"get_weather"}


def test_blocks_naming_known_tools_become_calls_and_the_rest_stays_content() -> None:
    text = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> Done.'
    content, calls = HermesToolParser().parse(text, NAMES)
    assert content == "Let me check.  Done."
    assert calls == [ParsedCall("get_weather", json.dumps({"city": "Oslo"}))]


def test_unknown_tools_and_broken_json_stay_text() -> None:
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>"):
        assert HermesToolParser().parse(text, NAMES) == (text, [])


def delta(text: str, finished: bool = False) -> RequestOutput:
    reason = FinishReason.STOP if finished else None
    return RequestOutput("r", (1,), text, finished, reason)


def stream_events(pieces: list[str]) -> list[dict]:
    tools = plan_tools([Tool(function=FunctionDefinition(name="get_weather"))], "auto")
    shape = ResponseShape("id", 0, "m", True, str, tools)
    stream = shape.stream_for(Choice(0, 0, [1], SamplingParams()))
    chunks = []
    for i, piece in enumerate(pieces):
        chunks += stream.chunks(delta(piece, finished=i == len(pieces) - 1))
    return [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]


def test_auto_stream_shows_text_and_holds_back_a_call() -> None:
    """Text before the call streams; the call (split over deltas, marker included) never shows
    as content and arrives as one tool_calls delta with finish reason tool_calls."""
    events = stream_events(["Sure", ". <tool", '_call>{"name": "get_weather", ', '"arguments": {}}</tool_call>', ""])
    content = "".join(e["delta"].get("content") or "" for e in events)
    assert content == "Sure. " and "<tool" not in content
    assert events[-1]["finish_reason"] == "tool_calls"
    assert events[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_auto_stream_without_a_call_loses_no_text() -> None:
    events = stream_events(["a < b", " and <to", "y>", ""])
    assert "".join(e["delta"].get("content") or "" for e in events) == "a < b and <toy>"
    assert events[-1]["finish_reason"] == "stop"
