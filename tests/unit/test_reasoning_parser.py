"""Reasoning parsers (runtime/reasoning.py): where each starts, the whole-reply split, the same split
streamed over every split point of a reply (tags cut across deltas), and the chat responses built
on it: `reasoning_content` beside `content`, and tool calls parsed from the content only."""

from __future__ import annotations

import json

import pytest

from ifb.runtime.guided import GuidedDecoding
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.reasoning import (
    THINK_CLOSE,
    ReasoningParserKind,
    ReasoningSplit,
    ReasoningStream,
    make_reasoning_parser,
    split_reasoning,
)
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.responses import Choice, ResponseShape
from ifb.runtime.server.tools import FunctionDefinition, Tool, plan_tools

QWEN3, R1 = ReasoningParserKind.QWEN3, ReasoningParserKind.DEEPSEEK_R1
SAMPLE = "<think>\nplan: 2 < 3 </thin k> ok\n</think>\n\nThe answer <is> 5."
OPEN_PROMPT = "<|user|>hi</s><|assistant|><think>\n"  # a template that opened the block itself


def stream_of(kind: ReasoningParserKind | None, prompt_tail: str = "", guided: bool = False) -> ReasoningStream:
    return make_reasoning_parser(kind).stream(prompt_tail, guided)


def split(kind: ReasoningParserKind | None, text: str, prompt_tail: str = "", guided: bool = False) -> ReasoningSplit:
    return split_reasoning(stream_of(kind, prompt_tail, guided), text)


def streamed(stream: ReasoningStream, pieces: list[str]) -> tuple[ReasoningSplit, list[ReasoningSplit]]:
    parts = [stream.feed(piece) for piece in pieces]
    parts.append(stream.finish())
    total = ReasoningSplit()
    for part in parts:
        total += part
    return total, parts


def test_qwen3_splits_a_reply_that_opens_the_tag() -> None:
    assert split(QWEN3, SAMPLE) == ReasoningSplit("\nplan: 2 < 3 </thin k> ok\n", "\n\nThe answer <is> 5.")


def test_qwen3_reply_without_a_tag_is_all_content_and_a_later_close_is_text() -> None:
    """The prompt did not open a block and the reply did not either: nothing is reasoning."""
    assert split(QWEN3, "just text") == ReasoningSplit("", "just text")
    assert split(QWEN3, "a</think>b") == ReasoningSplit("", "a</think>b")
    assert split(QWEN3, "x <think>y</think>") == ReasoningSplit("", "x <think>y</think>")


def test_qwen3_reads_a_block_the_prompt_opened() -> None:
    assert split(QWEN3, "plan</think>answer", prompt_tail=OPEN_PROMPT) == ReasoningSplit("plan", "answer")
    assert split(QWEN3, "still thinking", prompt_tail=OPEN_PROMPT) == ReasoningSplit("still thinking", "")
    closed = "<|assistant|><think>\n\n</think>\n\n"  # enable_thinking false: an empty block, closed
    assert split(QWEN3, "plan</think>answer", prompt_tail=closed) == ReasoningSplit("", "plan</think>answer")


def test_qwen3_truncated_thinking_is_reasoning() -> None:
    assert split(QWEN3, "<think>never closed") == ReasoningSplit("never closed", "")


def test_deepseek_r1_everything_before_the_first_close_is_reasoning() -> None:
    assert split(R1, "plan</think>answer</think>more") == ReasoningSplit("plan", "answer</think>more")
    assert split(R1, "<think>plan</think>answer") == ReasoningSplit("plan", "answer")
    assert split(R1, "no close at all") == ReasoningSplit("no close at all", "")


def test_no_parser_leaves_the_reply_as_content() -> None:
    assert split(None, SAMPLE) == ReasoningSplit("", SAMPLE)
    assert split(None, "<thi") == ReasoningSplit("", "<thi")


def test_a_guided_reply_starts_outside_any_block() -> None:
    """A grammar-made JSON answer is content even where the template opened a block."""
    assert split(R1, '{"a": 1}', guided=True) == ReasoningSplit("", '{"a": 1}')
    assert split(QWEN3, '{"a": 1}', prompt_tail=OPEN_PROMPT, guided=True) == ReasoningSplit("", '{"a": 1}')
    assert split(R1, "<think>x</think>y", guided=True) == ReasoningSplit("x", "y")


def test_a_reply_cut_inside_a_tag_keeps_the_partial_tag() -> None:
    """A tag's prefix held back for the next delta is sent when the reply ends there."""
    assert split(QWEN3, "<thi") == ReasoningSplit("", "<thi")
    assert split(R1, "<thi") == ReasoningSplit("<thi", "")
    assert split(QWEN3, "<think>plan</thi") == ReasoningSplit("plan</thi", "")
    assert split(QWEN3, "") == split(R1, "") == ReasoningSplit()


def shows_part_of_close_tag(part: ReasoningSplit) -> bool:
    """Reasoning sent while it ended in what could still become `</think>`."""
    return any(part.reasoning.endswith(THINK_CLOSE[:size]) for size in range(1, len(THINK_CLOSE)))


CASES = [
    (QWEN3, SAMPLE, ""),
    (QWEN3, "plan</think>answer", OPEN_PROMPT),
    (QWEN3, "no tags < here </think", ""),
    (R1, "<think>a</think>b</think>c", ""),
    (R1, "pl<an</think></think>", ""),
    (None, SAMPLE, ""),
]


@pytest.mark.parametrize(("kind", "text", "tail"), CASES)
def test_streaming_over_every_two_way_split_gives_the_whole_reply_split(
    kind: ReasoningParserKind | None, text: str, tail: str
) -> None:
    """Cut anywhere (inside either tag included), the streamed parts add up to the whole split,
    and no part ever shows a fragment of a tag."""
    whole = split(kind, text, tail)
    for cut in range(len(text) + 1):
        total, parts = streamed(stream_of(kind, tail), [text[:cut], text[cut:]])
        assert total == whole, cut
        assert not any(shows_part_of_close_tag(p) for p in parts[:-1]), cut


@pytest.mark.parametrize(("kind", "text", "tail"), CASES)
def test_streaming_one_character_at_a_time_gives_the_whole_reply_split(
    kind: ReasoningParserKind | None, text: str, tail: str
) -> None:
    total, parts = streamed(stream_of(kind, tail), list(text))
    assert total == split(kind, text, tail)
    assert not any(shows_part_of_close_tag(p) for p in parts[:-1])


def test_reasoning_streams_before_the_close_tag_arrives() -> None:
    """Incremental, not held to the end: reasoning goes out as it is generated."""
    stream = stream_of(QWEN3)
    assert stream.feed("<think>step one") == ReasoningSplit("step one", "")
    assert stream.feed(" two</") == ReasoningSplit(" two", "")
    assert stream.feed("think>Ans") == ReasoningSplit("", "Ans")
    assert stream.feed("wer") == ReasoningSplit("", "wer")


def test_parser_kind_comes_from_its_value() -> None:
    assert make_reasoning_parser("qwen3") == make_reasoning_parser(QWEN3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        make_reasoning_parser("nope")  # type: ignore[arg-type]


# -- chat responses built on the split ----------------------------------------------------------


def shape(kind: ReasoningParserKind | None, tools: bool = False) -> ResponseShape:
    plan = plan_tools([Tool(function=FunctionDefinition(name="f"))], "auto") if tools else None
    return ResponseShape("id", 0, "m", True, str, plan, make_reasoning_parser(kind))


def delta(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", (1,), text, finished, FinishReason.STOP if finished else None, num_output_tokens=1)


def message(s: ResponseShape, text: str, params: SamplingParams | None = None) -> dict:
    choice = Choice(0, 0, [1], params or SamplingParams())
    body = s.final_body([choice], [[delta(text, finished=True)]]).model_dump()["choices"][0]
    return {"finish_reason": body["finish_reason"], **body["message"]}


def stream_deltas(s: ResponseShape, pieces: list[str]) -> list[dict]:
    stream = s.stream_for(Choice(0, 0, [1], SamplingParams()))
    chunks = [c for i, piece in enumerate(pieces) for c in stream.chunks(delta(piece, i == len(pieces) - 1))]
    return [json.loads(c.removeprefix("data: "))["choices"][0]["delta"] for c in chunks]


def test_message_carries_reasoning_content_beside_content() -> None:
    assert message(shape(QWEN3), "<think>plan</think>answer") == {
        "finish_reason": "stop",
        "role": "assistant",
        "content": "answer",
        "reasoning_content": "plan",
    }
    assert message(shape(QWEN3), "answer") == {"finish_reason": "stop", "role": "assistant", "content": "answer"}
    assert message(shape(R1), "cut short")["content"] is None  # thinking only: no content


def test_without_a_parser_the_message_is_unchanged() -> None:
    assert message(shape(None), "<think>plan</think>answer") == {
        "finish_reason": "stop",
        "role": "assistant",
        "content": "<think>plan</think>answer",
    }


def test_tool_calls_are_parsed_from_the_content_only() -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    thought = message(shape(QWEN3, tools=True), f"<think>maybe {call}</think>no call")
    assert thought["reasoning_content"] == f"maybe {call}" and thought["content"] == "no call"
    assert "tool_calls" not in thought and thought["finish_reason"] == "stop"
    made = message(shape(QWEN3, tools=True), f"<think>call f</think>{call}")
    assert made["finish_reason"] == "tool_calls" and made["reasoning_content"] == "call f"
    assert made["tool_calls"][0]["function"]["name"] == "f"


def test_a_forced_tool_call_is_not_reasoning_under_deepseek_r1() -> None:
    """The grammar made the reply, so it is the call, though r1's template opens a block."""
    forced = plan_tools([Tool(function=FunctionDefinition(name="f"))], "required")
    s = ResponseShape("id", 0, "m", True, str, forced, make_reasoning_parser(R1))
    params = SamplingParams(guided=forced.guided)
    assert isinstance(params.guided, GuidedDecoding)
    reply = message(s, '{"name": "f", "arguments": {}}', params)
    assert reply["finish_reason"] == "tool_calls" and "reasoning_content" not in reply


def test_stream_sends_reasoning_deltas_then_content_deltas() -> None:
    deltas = stream_deltas(shape(QWEN3), ["<thi", "nk>pl", "an</th", "ink>ans", "wer"])
    assert deltas == [
        {"content": ""},  # "<thi": held, nothing to show yet
        {"reasoning_content": "pl"},
        {"reasoning_content": "an"},
        {"content": "ans"},
        {"content": "wer"},
        {},  # the final chunk: finish_reason only
    ]


def test_stream_with_tools_holds_a_call_in_the_content_not_in_the_reasoning() -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    deltas = stream_deltas(shape(QWEN3, tools=True), ["<think>I'll use <tool_", "call></think>", call])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I'll use <tool_call>"
    assert deltas[-1]["tool_calls"][0]["function"]["name"] == "f"
