"""Per-family tool-call parsers: each format read into calls, what stays text, the template-based
choice, the factory, and the stream's hold-back at each family's markers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ifb.cli.run_command import run
from ifb.cli.serving_options import server_settings
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.runtime_config import ServerSettings
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.responses import Choice, ResponseShape
from ifb.runtime.server.tool_parsers import (
    CallHoldBack,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    ParsedCall,
    ToolCallParserKind,
    make_tool_call_parser,
    tool_call_parser_for_template,
)
from ifb.runtime.server.tools import FunctionDefinition, Tool, plan_tools

HERMES, LLAMA3, MISTRAL = ToolCallParserKind.HERMES, ToolCallParserKind.LLAMA3_JSON, ToolCallParserKind.MISTRAL
NAMES = {"get_weather", "get_time"}
OSLO = ParsedCall("get_weather", json.dumps({"city": "Oslo"}))
UTC = ParsedCall("get_time", json.dumps({"zone": "UTC"}))

# Per family: a reply with one call, with two, with an unknown tool, with broken JSON.
ONE = {
    HERMES: '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
    LLAMA3: '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    MISTRAL: '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
}
TWO = {
    HERMES: ONE[HERMES] + '\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
    LLAMA3: ONE[LLAMA3] + '; {"name": "get_time", "arguments": {"zone": "UTC"}}',
    MISTRAL: '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
}
UNKNOWN = {
    HERMES: '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    LLAMA3: '{"name": "rm_rf", "parameters": {}}',
    MISTRAL: '[TOOL_CALLS]rm_rf[ARGS]{"path": "/"}',
}
BROKEN = {
    HERMES: '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
    LLAMA3: '{"name": "get_weather", "parameters": {"city": ',
    MISTRAL: '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}',
}


def parse(kind: ToolCallParserKind, text: str) -> tuple[str | None, list[ParsedCall]]:
    return make_tool_call_parser(kind).parse(text, NAMES)


@pytest.mark.parametrize("kind", list(ToolCallParserKind))
def test_one_call_becomes_a_call_with_its_arguments_as_a_json_string(kind: ToolCallParserKind) -> None:
    assert parse(kind, ONE[kind]) == (None, [OSLO])


@pytest.mark.parametrize("kind", list(ToolCallParserKind))
def test_several_calls_come_back_in_order(kind: ToolCallParserKind) -> None:
    assert parse(kind, TWO[kind]) == (None, [OSLO, UTC])


@pytest.mark.parametrize("kind", list(ToolCallParserKind))
@pytest.mark.parametrize("cases", [UNKNOWN, BROKEN], ids=["unknown_tool", "broken_json"])
def test_an_unknown_tool_or_broken_json_stays_text(kind: ToolCallParserKind, cases: dict[Any, str]) -> None:
    assert parse(kind, cases[kind]) == (cases[kind], [])


# Arguments given as a JSON string that decodes to a lone surrogate (no UTF-8 reply can carry it).
SURROGATE = {
    HERMES: r'<tool_call>{"name": "get_weather", "arguments": "\ud800"}</tool_call>',
    LLAMA3: r'{"name": "get_weather", "parameters": "\ud800"}',
    MISTRAL: r'[TOOL_CALLS] [{"name": "get_weather", "arguments": "\ud800"}]',
}


@pytest.mark.parametrize("kind", list(ToolCallParserKind))
def test_string_arguments_with_a_lone_surrogate_stay_text(kind: ToolCallParserKind) -> None:
    """Before, the call came out and the reply failed to encode (a 500, or a broken stream)."""
    assert parse(kind, SURROGATE[kind]) == (SURROGATE[kind], [])


def test_a_bad_call_stays_text_beside_a_good_one() -> None:
    """Only the block that fails is kept as content; the valid call still comes out."""
    hermes = parse(HERMES, UNKNOWN[HERMES] + ONE[HERMES])
    assert hermes == (UNKNOWN[HERMES], [OSLO])
    assert parse(LLAMA3, UNKNOWN[LLAMA3] + "; " + ONE[LLAMA3]) == (UNKNOWN[LLAMA3], [OSLO])
    assert parse(MISTRAL, UNKNOWN[MISTRAL] + ONE[MISTRAL]) == (UNKNOWN[MISTRAL], [OSLO])


def test_text_before_a_call_is_content_where_the_format_allows_it() -> None:
    """hermes and mistral calls may follow text; a llama3_json call is the whole reply, so a JSON
    object after prose is prose (what a stream, holding back only a reply that opens `{`, shows)."""
    assert parse(HERMES, "Let me check. " + ONE[HERMES]) == ("Let me check.", [OSLO])
    assert parse(MISTRAL, "Let me check. " + ONE[MISTRAL]) == ("Let me check.", [OSLO])
    prose = "Let me check. " + ONE[LLAMA3]
    assert parse(LLAMA3, prose) == (prose, [])


def test_llama3_json_takes_the_python_tag_leading_space_and_either_argument_key() -> None:
    reply = '\n <|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    assert parse(LLAMA3, reply) == (None, [OSLO])
    assert parse(LLAMA3, '{"name": "get_time"}') == (None, [ParsedCall("get_time", "{}")])
    assert parse(LLAMA3, "<|python_tag|>print(1)") == ("<|python_tag|>print(1)", [])  # code, not a call


def test_mistral_reads_v3_lists_v11_names_with_or_without_args_and_a_stripped_marker() -> None:
    """v3 `[TOOL_CALLS] [{...}, {...}]`; v11 `[TOOL_CALLS]name[ARGS]{...}` or `name{...}`; and the
    bare list a detokenizer that skips the special `[TOOL_CALLS]` token leaves."""
    two_v3 = (
        '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]'
    )
    assert parse(MISTRAL, "[TOOL_CALLS]" + two_v3) == (None, [OSLO, UTC])
    assert parse(MISTRAL, '[TOOL_CALLS]get_weather{"city": "Oslo"}') == (None, [OSLO])
    assert parse(MISTRAL, " " + two_v3) == (None, [OSLO, UTC])
    assert parse(MISTRAL, "[1, 2] are numbers") == ("[1, 2] are numbers", [])
    mixed = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]'
    assert parse(MISTRAL, mixed) == (mixed, [])  # a list with an unknown tool is text, all of it


LLAMA31_TEMPLATE = (
    "{%- if tools %}Given the following functions, please respond with a JSON for a function call. "
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}.' }}{%- endif %}"
)


@pytest.mark.parametrize(
    ("template", "kind"),
    [
        ("{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}", HERMES),
        ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", MISTRAL),
        ("{% if builtin_tools %}<|python_tag|>{% endif %}", LLAMA3),
        (LLAMA31_TEMPLATE, LLAMA3),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", HERMES),
        (None, HERMES),
    ],
    ids=["hermes", "mistral", "python_tag", "llama3_instruction", "no_format", "no_template"],
)
def test_the_chat_template_chooses_the_parser(template: str | None, kind: ToolCallParserKind) -> None:
    assert tool_call_parser_for_template(template) is kind


def test_the_factory_makes_one_class_per_kind_and_refuses_others() -> None:
    assert isinstance(make_tool_call_parser(HERMES), HermesToolParser)
    assert isinstance(make_tool_call_parser(LLAMA3), Llama3JsonToolParser)
    assert isinstance(make_tool_call_parser("mistral"), MistralToolParser)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        make_tool_call_parser("pythonic")  # type: ignore[arg-type]


def test_tool_call_parser_is_a_server_setting_and_a_flag() -> None:
    assert ServerSettings(tool_call_parser="llama3_json").tool_call_parser is LLAMA3  # type: ignore[arg-type]
    params = run.make_context("run", ["--tool-call-parser", "mistral"]).params
    assert server_settings(params, {}).app_options()["tool_call_parser"] is MISTRAL
    assert ServerSettings().tool_call_parser is None  # default: the chat template's choice


def feed_all(hold: CallHoldBack, pieces: list[str]) -> tuple[list[str], str]:
    return [hold.feed(p) for p in pieces], hold.finish()


@pytest.mark.parametrize(
    ("kind", "pieces", "shown"),
    [
        (HERMES, ["Sure", ". <tool", "_call>{", '"name": "x"}', "</tool_call>"], "Sure. "),
        (LLAMA3, ["\n", "<|py", "thon_tag|>{", '"name": "x"}'], ""),
        (LLAMA3, [" {", '"name": "x"}'], ""),
        (MISTRAL, ["Sure. [TOOL", "_CALLS]x[ARGS]{}"], "Sure. "),
        (MISTRAL, ['[{"name"', ': "x"}]'], ""),
    ],
    ids=["hermes", "llama3_tag", "llama3_brace", "mistral_marker", "mistral_bare_list"],
)
def test_a_stream_holds_back_from_where_a_call_opens(kind: ToolCallParserKind, pieces: list[str], shown: str) -> None:
    """No delta shows any part of a call, split across deltas as it may be; what is held is the
    call itself, for the parser at the end."""
    deltas, held = feed_all(CallHoldBack(make_tool_call_parser(kind).markers), pieces)
    assert "".join(deltas) == shown
    assert shown + held == "".join(pieces)


@pytest.mark.parametrize(
    ("kind", "pieces", "deltas", "held"),
    [
        (HERMES, ["a < b", " and <to", "y>"], ["a < b", " and ", "<toy>"], ""),
        (LLAMA3, ["<|py", "thon is fun"], ["", "<|python is fun"], ""),
        (LLAMA3, ["Use ", '{"name": "get_weather"}'], ["Use ", '{"name": "get_weather"}'], ""),
        (MISTRAL, ["See [the docs](x) ", "and [TOOL"], ["See [the docs](x) ", "and "], "[TOOL"),
    ],
    ids=["hermes", "llama3_tag_prefix", "llama3_prose_first", "mistral_link"],
)
def test_a_stream_without_a_call_shows_text_once_it_cannot_open_one(
    kind: ToolCallParserKind, pieces: list[str], deltas: list[str], held: str
) -> None:
    """A marker's possible start waits for the next delta, no longer; a llama3_json reply that
    opened with prose streams on, braces and all."""
    assert feed_all(CallHoldBack(make_tool_call_parser(kind).markers), pieces) == (deltas, held)


def delta(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", (1,), text, finished, FinishReason.STOP if finished else None)


def shape_for(kind: ToolCallParserKind) -> ResponseShape:
    tools = [Tool(function=FunctionDefinition(name=name)) for name in sorted(NAMES)]
    return ResponseShape("id", 0, "m", True, str, plan_tools(tools, "auto"), tool_parser=make_tool_call_parser(kind))


@pytest.mark.parametrize("kind", list(ToolCallParserKind))
def test_a_streamed_reply_gives_the_same_calls_and_content_as_a_whole_one(kind: ToolCallParserKind) -> None:
    """Through ResponseShape: the finished stream's tool_calls come from the chosen parser, and
    no content delta carries any of the call's text."""
    text = TWO[kind]
    body = shape_for(kind).final_body([Choice(0, 0, [1], SamplingParams())], [[delta(text, finished=True)]])
    message = body.model_dump()["choices"][0]["message"]
    stream = shape_for(kind).stream_for(Choice(0, 0, [1], SamplingParams()))
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)] + [""]
    chunks = [c for i, p in enumerate(pieces) for c in stream.chunks(delta(p, finished=i == len(pieces) - 1))]
    events = [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]
    assert "".join(e["delta"].get("content") or "" for e in events) == ""
    streamed = [(c["function"]["name"], c["function"]["arguments"]) for c in events[-1]["delta"]["tool_calls"]]
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert streamed == whole == [(OSLO.name, OSLO.arguments), (UTC.name, UTC.arguments)]
    assert events[-1]["finish_reason"] == "tool_calls" and message["content"] is None
