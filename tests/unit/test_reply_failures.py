"""A tool-call block nested too deep for Python's json stays text; a streamed reply whose shaping
raises anyway ends with an SSE error event and [DONE], never a cut connection, and its engine
stream is closed (which aborts the request in the engine). The end-to-end side, a 500 and the neighbours, is in
tests/e2e/test_request_failures.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Collection

import pytest

from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.responses import Choice, ResponseShape
from ifb.runtime.server.streams import sse_events
from ifb.runtime.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    ToolCallParser,
)
from ifb.runtime.server.tools import FunctionDefinition, Tool, plan_tools

# A call block nested deeper than Python's json can decode (RecursionError, not ValueError).
DEEP_CALL = "<tool_call>" + "[" * 100_000 + "</tool_call>"


DEEP = "[" * 100_000


@pytest.mark.parametrize(
    ("parser", "reply"),
    [
        (HermesToolParser(), DEEP_CALL),
        (Llama3JsonToolParser(), '{"name": "f", "parameters": ' + DEEP),
        (MistralToolParser(), "[TOOL_CALLS]" + DEEP),
    ],
    ids=["hermes", "llama3_json", "mistral"],
)
def test_a_call_block_nested_too_deep_stays_text(parser: ToolCallParser, reply: str) -> None:
    """Each parser's contract for broken JSON (the block stays text, no call) holds for nesting
    deeper than the interpreter's stack too: all three raised RecursionError before."""
    content, calls = parser.parse(reply, {"f"})
    assert calls == []
    assert content == reply


class _FailingParser(HermesToolParser):
    """Injected failure (no real reply makes a parser raise now): shaping the reply raises."""

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ParsedCall]]:
        raise RuntimeError("the parser broke")


def test_a_reply_the_tool_parser_cannot_read_ends_with_an_error_event() -> None:
    """Content before the call streams; the parser's failure at the end is an error event naming
    it, then [DONE]; the engine stream is closed."""
    closed: list[bool] = []

    async def engine_stream() -> AsyncIterator[RequestOutput]:
        try:
            yield RequestOutput("r", (1,), DEEP_CALL, True, FinishReason.STOP, num_output_tokens=2)
        finally:
            closed.append(True)

    tools = plan_tools([Tool(function=FunctionDefinition(name="f"))], "auto")
    shape = ResponseShape("id", 0, "m", True, str, tools, tool_parser=_FailingParser())
    choice = Choice(0, 0, [1], SamplingParams())
    head = RequestOutput("r", (1,), "Sure. ", False)

    async def run() -> list[str]:
        return [event async for event in sse_events(shape, [choice], [engine_stream()], [head], False)]

    events = [e.removeprefix("data: ").strip() for e in asyncio.run(run())]
    assert events[-1] == "[DONE]"
    bodies = [json.loads(e) for e in events[:-1]]
    assert [b["choices"][0]["delta"].get("content") for b in bodies[:2]] == ["", "Sure. "]
    assert bodies[-1]["error"]["code"] == "request_failed"
    assert bodies[-1]["error"]["message"].startswith("shaping the reply failed: RuntimeError")
    assert closed == [True]
