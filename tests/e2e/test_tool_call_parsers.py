"""Tool calls in the llama3_json and mistral formats through the HTTP server and the openai SDK,
streamed and not: the mistral parser chosen from the chat template, llama3_json by the
`tool_call_parser` setting (--tool-call-parser).

A random model never writes a call itself, so each reply is spelled out by a guided regex (the
tiny tokenizer spells any text); `tool_choice` stays `auto`, so the reply is read by the
family's parser exactly as a real model's would be."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_harness import running_server
from tiny_models import CHAT_TEMPLATE

from ifb import LLM
from ifb.runtime.server.tool_parsers import ToolCallParserKind

# The marker in a comment is enough for the choice, and keeps the tools out of the short prompt.
MISTRAL_TEMPLATE = "{# this model calls tools as [TOOL_CALLS]name[ARGS]{...} #}" + CHAT_TEMPLATE
TOOLS: Any = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("get_weather", "get_time")
]
ASK: Any = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def llm(tiny_llama_engine: Path) -> Iterator[LLM]:
    engine = LLM(tiny_llama_engine, max_batch_size=4, chat_template=MISTRAL_TEMPLATE)
    yield engine
    engine.close()


def both_ways(base: str, reply: str) -> tuple[Any, str, list[tuple[str, str]], str | None]:
    """The reply spelled out, asked for whole and streamed: the message, and the stream's
    content, calls (name, arguments) and last finish reason."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    common: Any = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 120}
    spelled = {"guided_regex": re.escape(reply)}
    message = client.chat.completions.create(**common, extra_body=spelled).choices[0]
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**common, extra_body=spelled, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += (call.function.name or "") if call.function else ""
                entry[1] += (call.function.arguments or "") if call.function else ""
    return message, content, [(name, arguments) for name, arguments in calls.values()], reason


def test_mistral_calls_after_text_chosen_from_the_template(llm: LLM) -> None:
    """v11 calls after some text: the text is content (streamed before the calls, with no part
    of the marker in any delta), the calls are tool_calls."""
    reply = 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'
    with running_server(llm, served_model_names=("tiny",)) as base:
        choice, content, calls, reason = both_ways(base, reply)
    expected = [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == expected
    assert (content, calls, reason) == ("Checking. ", expected, "tool_calls")


def test_llama3_json_calls_by_the_setting(llm: LLM) -> None:
    """The setting overrides the template's mistral: a reply that is a JSON call is one, and a
    stream shows none of it as content."""
    reply = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    with running_server(llm, served_model_names=("tiny",), tool_call_parser=ToolCallParserKind.LLAMA3_JSON) as base:
        choice, content, calls, reason = both_ways(base, reply)
    expected = [("get_weather", '{"city": "Oslo"}')]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == expected
    assert (content, calls, reason) == ("", expected, "tool_calls")


BOS = 1  # the tiny tokenizer's <s>: a special token


def reply_text(base: str, **body: Any) -> str:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    forced = {"logit_bias": {str(BOS): 100}, "max_tokens": 3, "temperature": 0}
    reply = client.chat.completions.create(model="tiny", messages=ASK, **forced, **body)  # type: ignore[call-overload]
    return reply.choices[0].message.content or ""


def test_a_reply_read_for_special_token_markers_keeps_special_tokens(llm: LLM) -> None:
    """Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens in real vocabularies:
    with tools offered (auto) the server detokenizes the reply with special tokens, unless the
    client set skip_special_tokens itself; without tools, special tokens stay out of the text."""
    with running_server(llm, served_model_names=("tiny",)) as base:  # mistral, from the template
        assert reply_text(base, tools=TOOLS) == "<s><s><s>"
        assert reply_text(base) == ""
        assert reply_text(base, tools=TOOLS, extra_body={"skip_special_tokens": True}) == ""
        assert reply_text(base, extra_body={"skip_special_tokens": False}) == "<s><s><s>"
        assert reply_text(base, tools=TOOLS, tool_choice="none") == ""


def test_a_finishing_eos_is_never_text(llm: LLM) -> None:
    from ifb import SamplingParams

    eos = next(iter(llm.frontend.eos_token_ids))
    for skip in (True, False):
        params = SamplingParams(max_tokens=4, temperature=0, logit_bias={eos: 100}, skip_special_tokens=skip)
        (output,) = llm.generate([[5, 6, 7]], params)
        assert (output.token_ids, output.text, output.finish_reason.value) == ((eos,), "", "stop")
    shown = SamplingParams(
        max_tokens=2, temperature=0, logit_bias={eos: 100}, ignore_eos=True, skip_special_tokens=False
    )
    assert llm.generate([[5, 6, 7]], shown)[0].text == "</s></s>"  # an EOS that does not finish is text
