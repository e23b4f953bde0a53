"""The wire shape of the typed response records: which keys are sent as null, which are left out."""

from __future__ import annotations

import json

from ifb.runtime.outputs import RequestOutput, TokenLogprob
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.errors import error_response
from ifb.runtime.server.responses import Choice, ResponseShape
from ifb.runtime.server.tools import FunctionDefinition, Tool, plan_tools

LOGPROBS = (TokenLogprob(1, -0.5, {1: -0.5, 2: -1.5}),)


def shape(chat: bool, tools: bool = False) -> ResponseShape:
    plan = plan_tools([Tool(function=FunctionDefinition(name="f"))], "auto") if tools else None
    return ResponseShape("id", 7, "m", chat, lambda t: "é" if t == 1 else "b", plan)


def done(text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> RequestOutput:
    return RequestOutput("r", (1,), text, True, FinishReason.STOP, logprobs, num_output_tokens=2)


def event(chunk: str) -> dict:
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    return json.loads(chunk.removeprefix("data: "))


def test_bodies_send_null_logprobs_and_tool_calls_only_when_called() -> None:
    choice = Choice(0, 0, [1, 2, 3], SamplingParams())
    text = shape(False).final_body([choice], [[done("hi")]]).model_dump()
    assert list(text) == ["id", "object", "created", "model", "choices", "usage"]
    assert text["choices"] == [{"index": 0, "text": "hi", "finish_reason": "stop", "logprobs": None}]
    assert text["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    plain = shape(True, tools=True).final_body([choice], [[done("hi")]]).model_dump()["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "hi"}
    called = shape(True, tools=True).final_body([choice], [[done('<tool_call>{"name": "f"}</tool_call>')]])
    body = called.model_dump()["choices"][0]
    assert body["finish_reason"] == "tool_calls" and body["message"]["content"] is None
    assert list(body["message"]["tool_calls"][0]) == ["id", "type", "function"]


def test_logprobs_blocks_in_both_shapes() -> None:
    choice = Choice(0, 0, [1], SamplingParams(logprobs=1))
    text = shape(False).final_body([choice], [[done("x", LOGPROBS)]]).model_dump()["choices"][0]["logprobs"]
    assert text == {"tokens": ["é"], "token_logprobs": [-0.5], "top_logprobs": [{"é": -0.5, "b": -1.5}]}
    chat = shape(True).final_body([choice], [[done("x", LOGPROBS)]]).model_dump()["choices"][0]["logprobs"]
    top = [{"token": "é", "bytes": [195, 169], "logprob": -0.5}, {"token": "b", "bytes": [98], "logprob": -1.5}]
    assert chat == {"content": [{**top[0], "top_logprobs": top}]}


def test_stream_chunks_leave_out_what_they_do_not_carry() -> None:
    s = shape(True, tools=True)
    role = event(s.role_chunk(0))
    assert role["object"] == "chat.completion.chunk"
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    stream = s.stream_for(Choice(0, 0, [1], SamplingParams()))
    *_, last = stream.chunks(done('<tool_call>{"name": "f"}</tool_call>'))
    final = event(last)["choices"][0]
    assert final["logprobs"] is None and final["finish_reason"] == "tool_calls"
    assert list(final["delta"]) == ["tool_calls"] and list(final["delta"]["tool_calls"][0])[0] == "index"
    empty_end = shape(True).stream_for(Choice(0, 0, [1], SamplingParams())).chunks(done(""))[-1]
    assert event(empty_end)["choices"][0]["delta"] == {}
    usage = event(s.chunk([], usage=shape(True).final_body([], []).usage))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 0
    assert "usage" not in event(s.role_chunk(0))


def test_error_event_has_no_param_and_error_bodies_send_null() -> None:
    failed = RequestOutput("r", (), "", True, FinishReason.ERROR, error="boom")
    assert event(shape(True).error_event(failed)) == {
        "error": {"message": "boom", "type": "server_error", "code": "request_failed"}
    }
    body = json.loads(error_response(400, "bad").body)
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": "invalid_request_error"}
    }
