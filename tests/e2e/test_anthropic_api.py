"""Anthropic's Messages API on the real server, driven by the official `anthropic` SDK: the same
replies as the OpenAI chat route (one request path), stop reasons, streaming events, tool_use /
tool_result, thinking blocks, count_tokens, Anthropic's error shape and x-api-key."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from server_harness import running_server

from ifb import LLM

HI: list[Any] = [{"role": "user", "content": "hi"}]
# The SDK no longer takes temperature (newer models drop it); the server still reads it.
GREEDY: dict[str, Any] = {"model": "tiny", "extra_body": {"temperature": 0}}
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
MAX_CALL_TOKENS = 120  # the tiny tokenizer is nearly per-character: a whole call takes ~80 tokens
KEY = "sekret"


def sdk(url: str, **options: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=options.pop("api_key", "none"), max_retries=0, **options)


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def openai_chat(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_message_is_the_chat_routes_reply(chat_server: str) -> None:
    """The same greedy tokens, prompt and counts as /v1/chat/completions: one request path."""
    message = sdk(chat_server).messages.create(messages=HI, max_tokens=8, **GREEDY)
    chat = openai_chat(chat_server, messages=HI, max_tokens=8, temperature=0)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == "tiny"
    assert [block.type for block in message.content] == ["text"]
    assert text_of(message) == chat["choices"][0]["message"]["content"] and text_of(message)
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert message.stop_reason == expected and message.stop_sequence is None


def test_system_and_turns_make_the_chat_prompt(chat_server: str) -> None:
    turns: list[Any] = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [{"type": "text", "text": "hi there"}]},
        {"role": "user", "content": [{"type": "text", "text": "how "}, {"type": "text", "text": "are you"}]},
    ]
    as_openai = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "how are you"},
    ]
    ids = httpx.post(chat_server + "/tokenize", json={"messages": as_openai}).json()["tokens"]
    client = sdk(chat_server)
    as_string = client.messages.create(system="be brief", messages=turns, max_tokens=4, **GREEDY)
    as_blocks = client.messages.create(
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        messages=turns,
        max_tokens=4,
        **GREEDY,
    )
    alone = client.messages.create(messages=turns[-1:], max_tokens=4, **GREEDY)
    assert as_string.usage.input_tokens == as_blocks.usage.input_tokens == len(ids)
    assert alone.usage.input_tokens < len(ids)
    chat = openai_chat(chat_server, messages=as_openai, max_tokens=4, temperature=0)
    assert text_of(as_string) == text_of(as_blocks) == chat["choices"][0]["message"]["content"]


def test_max_tokens_and_stop_sequences(chat_server: str) -> None:
    """A reply cut at max_tokens says so; a stop sequence taken from the middle of the greedy
    reply ends it just before, and is named."""
    client = sdk(chat_server)
    long = client.messages.create(messages=HI, max_tokens=24, **GREEDY)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 24, long
    text = text_of(long)
    stop = text[8:11]
    cut = client.messages.create(messages=HI, max_tokens=24, stop_sequences=["zzzz", stop], **GREEDY)
    assert text_of(cut) == text[: text.find(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.usage.output_tokens < 24


def test_streamed_events_come_in_anthropics_order(chat_server: str) -> None:
    whole = sdk(chat_server).messages.create(messages=HI, max_tokens=16, **GREEDY)
    with sdk(chat_server).messages.stream(messages=HI, max_tokens=16, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in _RAW_EVENTS]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and len(kinds) > 6  # a delta per token or so
    deltas = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
    assert "".join(deltas) == text_of(whole) == text_of(final)
    message_delta = next(e for e in events if e.type == "message_delta")
    assert message_delta.delta.stop_reason == whole.stop_reason
    assert message_delta.usage.output_tokens == whole.usage.output_tokens
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == whole.usage.input_tokens


_RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


def test_tool_choice_any_calls_a_tool_and_takes_its_result(chat_server: str) -> None:
    client = sdk(chat_server)
    asked: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
    common: dict[str, Any] = {"tools": [WEATHER], "max_tokens": MAX_CALL_TOKENS, **GREEDY}
    first = client.messages.create(messages=asked, tool_choice={"type": "any"}, **common)
    assert first.stop_reason == "tool_use", first
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(messages=asked, tool_choice={"type": "any"}, **common) as stream:
        partial = "".join(e.delta.partial_json for e in stream if e.type == "content_block_delta")
        streamed = stream.get_final_message()
    assert json.loads(partial) == call.input and streamed.stop_reason == "tool_use"
    result = '{"temp": 21}'
    conversation: list[Any] = [
        *asked,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]},
    ]
    follow = client.messages.create(messages=conversation, tool_choice={"type": "none"}, **common)
    assert follow.stop_reason in ("end_turn", "max_tokens") and text_of(follow)
    as_openai = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [_openai_call(call)]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    ids = httpx.post(chat_server + "/tokenize", json={"messages": as_openai}).json()["tokens"]
    assert follow.usage.input_tokens == len(ids)  # the call and its result are in the prompt


def _openai_call(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}


def test_count_tokens_is_the_messages_input_tokens(chat_server: str) -> None:
    client = sdk(chat_server)
    body: dict[str, Any] = {"model": "tiny", "system": "be brief", "messages": HI, "tools": [WEATHER]}
    counted = client.messages.count_tokens(**body)
    message = client.messages.create(max_tokens=1, **body)
    assert counted.input_tokens == message.usage.input_tokens
    assert client.messages.count_tokens(model="tiny", messages=HI).input_tokens < counted.input_tokens


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": HI}, "max_tokens"),
        ({"messages": HI, "max_tokens": 4, "temperature": 1.5}, "temperature"),
        ({"messages": HI, "max_tokens": 4, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4}, "image"),
        ({"messages": HI, "max_tokens": 4, "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": HI, "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 2}}, "thinking"),
    ],
)
def test_bad_requests_get_anthropics_error_shape(chat_server: str, body: dict[str, Any], named: str) -> None:
    response = httpx.post(chat_server + "/v1/messages", json={"model": "tiny", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


def test_an_unknown_model_is_anthropics_404(chat_server: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk(chat_server).messages.create(model="gpt-9", messages=HI, max_tokens=4)
    body: Any = missing.value.body
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "gpt-9" in body["error"]["message"]


def test_the_api_key_comes_as_x_api_key_or_bearer(thinking_llm: LLM) -> None:
    """Anthropic's clients send `x-api-key` (this SDK version sends its api_key as a Bearer token,
    so the header is given as older versions and Claude Code send it)."""
    with running_server(thinking_llm, served_model_names=("tiny",), api_key=KEY) as url:
        x_api_key = anthropic.Anthropic(base_url=url, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0)
        assert x_api_key.messages.create(messages=HI, max_tokens=2, **GREEDY).content
        assert sdk(url, api_key=KEY).messages.create(messages=HI, max_tokens=2, **GREEDY).content  # Bearer
        for headers in ({"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}, {}):
            refused = httpx.post(
                url + "/v1/messages", json={"model": "tiny", "messages": HI, "max_tokens": 2}, headers=headers
            )
            assert refused.status_code == 401, headers
            assert refused.json()["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            sdk(url, api_key="wrong").messages.create(messages=HI, max_tokens=2, **GREEDY)
        chat = httpx.post(url + "/v1/chat/completions", json={"messages": HI}, headers={"x-api-key": "wrong"})
        assert chat.status_code == 401 and "param" in chat.json()["error"]  # the OpenAI routes keep their shape


def test_thinking_comes_as_a_thinking_block(thinking_server: str) -> None:
    """The template opened <think>: with a budget of 3 tokens the reasoning is the first 3
    tokens' text, then content; streamed, thinking deltas come before text deltas."""
    client = sdk(thinking_server)
    first_three = client.messages.create(messages=HI, max_tokens=3, **GREEDY)
    assert [b.type for b in first_three.content] == ["thinking"]
    thinking = {"type": "enabled", "budget_tokens": 3}
    message = client.messages.create(messages=HI, max_tokens=24, thinking=thinking, **GREEDY)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == first_three.content[0].thinking  # type: ignore[union-attr]
    with client.messages.stream(messages=HI, max_tokens=24, thinking=thinking, **GREEDY) as stream:
        deltas = [e.delta for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    kinds = [d.type for d in deltas if d.type != "signature_delta"]
    assert kinds == sorted(kinds, reverse=True) and "text_delta" in kinds  # thinking_delta first
    assert final.content[0].thinking == message.content[0].thinking  # type: ignore[union-attr]
    assert text_of(final) == text_of(message)
    off = client.messages.create(messages=HI, max_tokens=4, thinking={"type": "disabled"}, **GREEDY)
    assert [b.type for b in off.content] == ["text"]  # enable_thinking false: the template closed the block
