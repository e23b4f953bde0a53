"""OpenAI's Responses API on the real server, driven by the official `openai` SDK: the same replies
as the chat route (one request path), message items and instructions, the streamed events in
their order, function calls and their outputs, text.format through guided decoding, reasoning
items, stored responses and previous_response_id, and refusals that name the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

GREEDY: dict[str, Any] = {"model": "tiny", "temperature": 0}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": WEATHER_PARAMETERS,
}
MAX_CALL_TOKENS = 120  # the tiny tokenizer is nearly per-character: a whole call takes ~80 tokens


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens(url: str, messages: list[dict[str, Any]]) -> int:
    return len(httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"])


def test_a_response_is_the_chat_routes_reply(chat_server: str) -> None:
    """The same greedy tokens and counts as /v1/chat/completions; cut at max_output_tokens, the
    response says it is incomplete."""
    response = sdk(chat_server).responses.create(input="hi", max_output_tokens=8, **GREEDY)
    reply = chat(chat_server, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == reply["choices"][0]["message"]["content"] and response.output_text
    assert response.usage is not None
    assert response.usage.input_tokens == reply["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == reply["usage"]["completion_tokens"] == 8
    assert response.usage.total_tokens == reply["usage"]["total_tokens"]
    assert reply["choices"][0]["finish_reason"] == "length"
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_items_make_the_chat_prompt(chat_server: str) -> None:
    items: list[Any] = [
        {"role": "user", "content": "hello"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi there"}]},
        {"role": "developer", "content": "answer in one word"},
        {"role": "user", "content": [{"type": "input_text", "text": "how "}, {"type": "input_text", "text": "are"}]},
    ]
    as_chat = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "developer", "content": "answer in one word"},
        {"role": "user", "content": "how are"},
    ]
    response = sdk(chat_server).responses.create(instructions="be brief", input=items, max_output_tokens=6, **GREEDY)
    assert response.usage is not None and response.usage.input_tokens == prompt_tokens(chat_server, as_chat)
    reply = chat(chat_server, messages=as_chat, max_tokens=6, temperature=0)
    assert response.output_text == reply["choices"][0]["message"]["content"]
    assert response.instructions == "be brief"


def test_top_p_reaches_the_sampler(chat_server: str) -> None:
    """A nucleus of one token at temperature 1 is the greedy reply (top_p is not dropped)."""
    client = sdk(chat_server)
    greedy = client.responses.create(input="hi", max_output_tokens=12, **GREEDY)
    nucleus = client.responses.create(model="tiny", input="hi", max_output_tokens=12, temperature=1, top_p=1e-6)
    assert nucleus.output_text == greedy.output_text and nucleus.top_p == 1e-6


def test_streamed_events_come_in_the_documented_order(chat_server: str) -> None:
    client = sdk(chat_server)
    whole = client.responses.create(input="hi", max_output_tokens=16, **GREEDY)
    # As Codex asks: streamed, not stored, encrypted reasoning included (there is none to carry).
    codex: dict[str, Any] = {"stream": True, "store": False, "include": ["reasoning.encrypted_content"]}
    events = list(client.responses.create(input="hi", max_output_tokens=16, **codex, **GREEDY))
    kinds = [event.type for event in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:-1] == tail, kinds
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 10  # a delta per token or so
    assert kinds[-1] == "response.incomplete"  # 16 tokens cut it (test_a_response_is_the_chat_routes_reply)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == whole.output_text == final.output_text == events[-4].text  # type: ignore[union-attr]
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"  # type: ignore[union-attr]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)  # store: false


def test_a_function_call_and_its_output_round_trip(chat_server: str) -> None:
    client = sdk(chat_server)
    asked: list[Any] = [{"role": "user", "content": "weather in Paris?"}]
    common: dict[str, Any] = {"tools": [WEATHER], "max_output_tokens": MAX_CALL_TOKENS, **GREEDY}
    first = client.responses.create(input=asked, tool_choice="required", **common)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    named = client.responses.create(input=asked, tool_choice={"type": "function", "name": "get_weather"}, **common)
    assert [item.type for item in named.output] == ["function_call"]
    with client.responses.stream(input=asked, tool_choice="required", **common) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments and streamed.output[0].arguments == call.arguments  # type: ignore[union-attr]
    result = '{"temp": 21}'
    conversation: list[Any] = [
        *asked,
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    follow = client.responses.create(input=conversation, tool_choice="none", **common)
    assert [item.type for item in follow.output] == ["message"] and follow.output_text
    as_chat = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [_chat_call(call)]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    assert follow.usage is not None and follow.usage.input_tokens == prompt_tokens(chat_server, as_chat)


def _chat_call(call: Any) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def test_text_format_json_schema_is_guided(chat_server: str) -> None:
    """text.format json_schema constrains the reply as chat's response_format does: the same text."""
    schema = {
        "type": "object",
        "properties": {"mood": {"enum": ["calm", "busy"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["mood", "n"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}}
    response = sdk(chat_server).responses.create(input="where?", text=text, max_output_tokens=60, **GREEDY)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(response.output_text), schema)
    format_ = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    reply = chat(
        chat_server,
        messages=[{"role": "user", "content": "where?"}],
        response_format=format_,
        max_tokens=60,
        temperature=0,
    )
    assert response.output_text == reply["choices"][0]["message"]["content"]


def test_stored_responses_and_previous_response_id(chat_server: str) -> None:
    client = sdk(chat_server)
    first = client.responses.create(input="hi", max_output_tokens=4, **GREEDY)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(previous_response_id=first.id, input="more", max_output_tokens=4, **GREEDY)
    as_chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "more"},
    ]
    assert second.usage is not None and second.usage.input_tokens == prompt_tokens(chat_server, as_chat)
    assert second.previous_response_id == first.id
    third = client.responses.create(previous_response_id=second.id, input="again", max_output_tokens=4, **GREEDY)
    as_chat += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "again"}]
    assert third.usage is not None and third.usage.input_tokens == prompt_tokens(chat_server, as_chat)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(first.id)
    assert first.id in str(gone.value) and "store" in str(gone.value)
    unstored = client.responses.create(input="hi", max_output_tokens=2, store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(previous_response_id=unstored.id, input="more", max_output_tokens=2, **GREEDY)
    assert refused.value.param == "previous_response_id"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("extra", "param", "said"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
        ({"background": True}, "background", "background"),
        ({"stop": ["x"]}, "stop", "stop"),  # not a Responses field
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0", "input_image"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type", "item_reference"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice"),
        ({"truncation": "auto"}, "truncation", "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include.0", "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning.effort"),
        ({"conversation": "conv_1"}, "conversation", "conversation"),
        ({"max_tool_calls": 2}, "max_tool_calls", "max_tool_calls"),
        ({"previous_response_id": "resp_missing"}, "previous_response_id", "resp_missing"),
        ({"max_reasoning_tokens": 2}, "max_reasoning_tokens", "reasoning parser"),  # none on this server
    ],
)
def test_unsupported_fields_are_refused_by_name(chat_server: str, extra: dict[str, Any], param: str, said: str) -> None:
    response = httpx.post(chat_server + "/v1/responses", json={"model": "tiny", "input": "hi", **extra}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert said in error["message"], error


def test_an_unknown_model_is_a_404(chat_server: str) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        sdk(chat_server).responses.create(model="gpt-9", input="hi")
    assert "gpt-9" in str(missing.value)


def test_reasoning_comes_as_a_reasoning_item(chat_server: str, thinking_server: str) -> None:
    """The template opened <think>: the reasoning item holds what chat's reasoning_content
    holds; with a budget of 3 tokens the reasoning is the first 3 tokens' text, then a message,
    streamed as reasoning_text deltas before output_text deltas; effort none turns thinking off
    in the template."""
    client = sdk(thinking_server)
    unbudgeted = client.responses.create(input="hi", max_output_tokens=24, **GREEDY)
    reply = chat(thinking_server, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=0)
    assert [item.type for item in unbudgeted.output] == ["reasoning"]  # 24 tokens stay inside the block
    assert _reasoning_text(unbudgeted) == reply["choices"][0]["message"]["reasoning_content"]
    first_three = client.responses.create(input="hi", max_output_tokens=3, **GREEDY)
    budget: dict[str, Any] = {"max_reasoning_tokens": 3}
    response = client.responses.create(input="hi", max_output_tokens=24, extra_body=budget, **GREEDY)
    assert [item.type for item in response.output] == ["reasoning", "message"] and response.output_text
    assert _reasoning_text(response) == _reasoning_text(first_three)
    usage = response.usage
    assert usage is not None and 3 <= usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    events = list(client.responses.create(input="hi", max_output_tokens=24, stream=True, extra_body=budget, **GREEDY))
    kinds = [e.type for e in events if e.type in ("response.reasoning_text.delta", "response.output_text.delta")]
    assert kinds == sorted(kinds, reverse=True) and "response.output_text.delta" in kinds  # reasoning first
    streamed = events[-1].response  # type: ignore[union-attr]
    assert _reasoning_text(streamed) == _reasoning_text(response) and streamed.output_text == response.output_text
    off = client.responses.create(input="hi", max_output_tokens=4, reasoning={"effort": "none"}, **GREEDY)
    assert [item.type for item in off.output] == ["message"]  # the template closed the block
    plain = sdk(chat_server).responses.create(input="hi", max_output_tokens=4, **GREEDY)
    assert [item.type for item in plain.output] == ["message"]  # no parser: the reply as generated


def _reasoning_text(response: Any) -> str:
    (item,) = [item for item in response.output if item.type == "reasoning"]
    return "".join(part.text for part in item.content)
