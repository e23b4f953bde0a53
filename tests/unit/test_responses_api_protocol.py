"""The Responses API's translation into the chat request, and its response store, without an
engine: what an agent's transcript becomes, and what is refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from ifb.runtime.errors import AdmissionError
from ifb.runtime.server.responses_api_protocol import ResponsesRequest
from ifb.runtime.server.responses_api_store import ResponseStore, StoredResponse

CALL = {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": '{"path": "."}'}


def chat_messages(**body: Any) -> list[dict[str, Any]]:
    return ResponsesRequest.model_validate(body).chat_request([]).chat_messages()


def test_an_agent_transcript_becomes_chat_turns() -> None:
    """Codex's shape: reasoning, a message and a call make one assistant turn (the reasoning not
    shown), the call's output a tool message."""
    transcript: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        CALL,
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
    ]
    messages = chat_messages(instructions="be brief", input=transcript)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["content"] == "Looking."
    assert messages[2]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}
    ]
    assert messages[3] == {"role": "tool", "content": "a.txt", "tool_call_id": "call_1"}


def test_a_call_with_no_message_before_it_opens_an_assistant_turn() -> None:
    messages = chat_messages(input=[{"role": "user", "content": "go"}, CALL, CALL | {"call_id": "call_2"}])
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_1", "call_2"]


def test_the_earlier_conversation_comes_first_and_instructions_before_it() -> None:
    body = ResponsesRequest.model_validate({"instructions": "sys", "input": "again"})
    earlier = [{"type": "message", "role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    messages = body.chat_request(earlier).chat_messages()
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "sys"),
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "again"),
    ]


def test_fields_map_onto_the_chat_request() -> None:
    tool = {"type": "function", "name": "ls", "parameters": {"type": "object", "properties": {}}}
    chat = ResponsesRequest.model_validate(
        {
            "input": "hi",
            "max_output_tokens": 7,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [tool],
            "tool_choice": {"type": "function", "name": "ls"},
            "parallel_tool_calls": False,
            "reasoning": {"effort": "none"},
        }
    ).chat_request([])
    params = chat.sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p) == (7, 0.5, 0.9)
    plan = chat.tool_plan()
    assert (plan.mode, plan.named, plan.parallel) == ("named", "ls", False)
    assert chat.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input.0.content.0"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": [CALL | {"arguments": "{not json"}]}, "input.0.arguments"),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
            "input.0.output",
        ),
        ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools.0.type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "x", "bogus": 1}]}, "tools.0.bogus"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "max_tool_calls": 0}, "max_tool_calls"),
        ({"input": []}, "input"),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(body: dict[str, Any], field: str) -> None:
    with pytest.raises(AdmissionError) as refused:
        ResponsesRequest.model_validate(body).chat_request([])
    assert refused.value.field == field


def test_the_store_keeps_the_most_recent_responses() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is None and store.get("b") is not None  # "b" is now the most recently used
    store.put("d", StoredResponse({"id": "d"}, []))
    assert store.get("c") is None and store.get("b") is not None and store.get("d") is not None
    assert store.delete("b") and not store.delete("b")
