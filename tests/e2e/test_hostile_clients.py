"""Careless and hostile clients: bad input is a 400 naming the field (never a 500), one bad row
fails alone, a dead or stuck step loop is a state every entry point sees."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import running_server
from waiting import wait_until

from ifb import LLM, SamplingParams
from ifb.runtime import executor as executor_module
from ifb.runtime.request import FinishReason


@pytest.fixture(scope="module")
def served(tiny_llama_engine: Path) -> Iterator[tuple[str, LLM]]:
    llm = LLM(tiny_llama_engine, max_batch_size=4, max_queued_requests=4)
    with running_server(llm) as base:
        yield base, llm
    llm.close()


BAD_INPUTS: list[tuple[str, dict[str, Any], str, int]] = [
    ("/v1/completions", {"prompt": [5], "top_k": 2**63}, "top_k", 400),
    ("/v1/completions", {"prompt": [5], "top_k": 100000}, "top_k", 400),  # > vocab
    ("/v1/completions", {"prompt": [5], "seed": 2**64}, "seed", 400),
    ("/v1/completions", {"prompt": [5], "seed": -(2**63) - 1}, "seed", 400),
    ("/v1/completions", {"prompt": [5], "seed": 2**63 - 1, "n": 2}, "seed", 400),
    ("/v1/completions", {"prompt": [True, False]}, "prompt", 400),
    ("/v1/completions", {"prompt": [5], "best_of": -3}, "best_of", 400),
    ("/v1/completions", {"prompt": [5], "echo": True}, "echo", 400),
    ("/v1/completions", {"prompt": [5], "suffix": "x"}, "suffix", 400),
    ("/v1/completions", {"prompt": [5], "stop_token_ids": list(range(300))}, "stop_token_ids", 400),
    ("/v1/completions", {"prompt": [[5]] * 9, "n": 1}, "prompt", 400),  # 9 > capacity 8: never fits
    ("/v1/completions", {"prompt": [5], "n": 9}, "n", 400),
    ("/v1/completions", {"prompt": [5], "model": "nope"}, "model", 404),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "messages.0.content.0.text",
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content.0",
        400,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
        "top_logprobs",
        400,
    ),
]


@pytest.mark.parametrize(("path", "body", "field", "status"), BAD_INPUTS)
def test_bad_input_is_refused_naming_the_field(
    served: tuple[str, LLM], path: str, body: dict[str, Any], field: str, status: int
) -> None:
    base, _ = served
    with httpx.Client(base_url=base) as client:
        response = client.post(path, json={"max_tokens": 2, **body})
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == field
        # the keep-alive connection survives a client mistake
        assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_lone_surrogate_is_a_400(served: tuple[str, LLM], path: str) -> None:
    base, _ = served
    text = '"a\\ud800b"'  # valid JSON, not encodable as UTF-8
    body = (
        '{"prompt": ' + text + ', "max_tokens": 2}'
        if "chat" not in path
        else '{"messages": [{"role": "user", "content": ' + text + "}]}"
    )
    response = httpx.post(base + path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] in ("prompt", "messages.0.content")


BAD = "a\ud800b"  # a lone surrogate: valid JSON once escaped, not encodable as UTF-8
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}


def _tool(description: str = "d", parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function = {"name": "f", "description": description, "parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": function}


# (path, body, the param the 400 names, the place its message names)
GRAMMAR_TEXTS: list[tuple[str, dict[str, Any], str, str]] = [
    ("/v1/completions", {"guided_choice": ["ok", BAD]}, "guided_choice", "guided_choice.1"),
    ("/v1/completions", {"guided_regex": BAD}, "guided_regex", "guided_regex"),
    ("/v1/completions", {"guided_grammar": f'root ::= "{BAD}"'}, "guided_grammar", "guided_grammar"),
    ("/v1/completions", {"guided_json": {"enum": ["ok", BAD]}}, "guided_json", "guided_json.enum.1"),
    (
        "/v1/completions",
        {"guided_json": {"type": "object", "properties": {"x": {"type": "string", "description": BAD}}}},
        "guided_json",
        "guided_json.properties.x.description",
    ),
    ("/v1/completions", {"guided_json": {"properties": {BAD: {}}}}, "guided_json", "guided_json.properties"),
    # a schema given as text, whose own JSON escapes the surrogate
    ("/v1/completions", {"guided_json": json.dumps({"const": BAD})}, "guided_json", "guided_json.const"),
    (
        "/v1/completions",
        {"structured_outputs": {"choice": [BAD]}},
        "structured_outputs.choice",
        "structured_outputs.choice.0",
    ),
    ("/v1/completions", {"structured_outputs": {"regex": BAD}}, "structured_outputs.regex", "structured_outputs.regex"),
    (
        "/v1/completions",
        {"structured_outputs": {"json": {"const": BAD}}},
        "structured_outputs.json",
        "structured_outputs.json.const",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"const": BAD}}}},
        "response_format",
        "response_format.const",
    ),
    ("/v1/chat/completions", {**CHAT, "tools": [_tool(description=BAD)]}, "tools", "tools.0.function.description"),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [_tool(parameters={"properties": {"x": {"enum": [BAD]}}})], "tool_choice": "required"},
        "tools",
        "tools.0.function.parameters.properties.x.enum.0",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [_tool(parameters={"title": BAD})], "tool_choice": {"function": {"name": "f"}}},
        "tools",
        "tools.0.function.parameters.title",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "place"), GRAMMAR_TEXTS, ids=[place for *_, place in GRAMMAR_TEXTS])
def test_lone_surrogate_in_a_grammar_or_tool_string_is_a_400(
    served: tuple[str, LLM], path: str, body: dict[str, Any], param: str, place: str
) -> None:
    """Every string that reaches a grammar or the chat template is checked like a prompt: a 400
    naming the request field (its message names the place inside it), never a 200 that
    generates or a 500."""
    base, _ = served
    content = json.dumps({"prompt": "x", "max_tokens": 2, **body} if "chat" not in path else {"max_tokens": 2, **body})
    response = httpx.post(base + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and place in error["message"] and "Unicode" in error["message"], error


def test_a_row_that_cannot_be_sampled_fails_alone(served: tuple[str, LLM]) -> None:
    """A sampling fault in one row ends that request with `error` (a 500 / an SSE error event to
    its client); a greedy neighbour in the same steps finishes every token."""
    base, llm = served
    sampler = llm.executor.sampler
    sample = sampler.sample

    def faulty(logits, rows, bitmask=None):  # type: ignore[no-untyped-def]
        if any(row.request.params.temperature == 1.25 for row in rows):
            raise RuntimeError("injected sampling fault")
        return sample(logits, rows, bitmask)

    sampler.sample = faulty  # type: ignore[method-assign]
    try:
        neighbour: list[Any] = []
        llm.submit([5, 6, 7], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), neighbour.append)
        bad = httpx.post(base + "/v1/completions", json={"prompt": [9, 9], "max_tokens": 5, "temperature": 1.25})
        assert bad.status_code == 500 and "injected sampling fault" in bad.json()["error"]["message"]
        stream_body = {"prompt": [9, 9], "max_tokens": 5, "temperature": 1.25, "stream": True}
        lines = [line for line in httpx.post(base + "/v1/completions", json=stream_body).text.splitlines() if line]
        assert any("injected sampling fault" in line and '"error"' in line for line in lines)
        wait_until(lambda: bool(neighbour) and neighbour[-1].finished, 30, "the neighbour to finish")
        assert neighbour[-1].finish_reason is FinishReason.LENGTH and neighbour[-1].num_output_tokens == 30
    finally:
        sampler.sample = sample  # type: ignore[method-assign]


def test_a_dead_step_loop_is_seen_everywhere(tiny_llama_engine: Path) -> None:
    """The loop dies (a fault outside any step): resident requests end with `error`, /health and
    new requests are 503 at once."""
    llm = LLM(tiny_llama_engine, max_batch_size=2)
    with running_server(llm) as base:
        resident: list[Any] = []
        llm.submit([5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), resident.append)
        wait_until(lambda: len(resident) > 2, 30, "tokens of the resident request")

        def broken() -> None:
            raise RuntimeError("injected scheduler fault")

        llm.executor.scheduler.schedule = broken  # type: ignore[method-assign]
        wait_until(lambda: bool(resident) and resident[-1].finished, 30, "the resident request to end")
        assert resident[-1].finish_reason is FinishReason.ERROR and "died" in (resident[-1].error or "")
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and "injected scheduler fault" in health.json()["executor"]["error"]
        # refused before it reaches the dead loop (httpx's 5 s timeout would fail a queued one)
        refused = httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert refused.status_code == 503 and "injected scheduler fault" in refused.json()["error"]["message"]
    llm.close()


def test_a_stuck_step_is_seen_everywhere(tiny_llama_engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that runs past the watchdog: /health 503 `stuck` and new requests 503 meanwhile."""
    monkeypatch.setattr(executor_module, "STUCK_STEP_S", 0.3)
    llm = LLM(tiny_llama_engine, max_batch_size=2)
    step = llm.engine.step

    release = threading.Event()

    def hanging(inputs):  # type: ignore[no-untyped-def]
        release.wait(60)  # held until the test has seen the stuck state from outside
        return step(inputs)

    with running_server(llm) as base:
        llm.engine.step = hanging  # type: ignore[method-assign]
        llm.submit([5, 6], SamplingParams(max_tokens=1, temperature=0), lambda o: None)
        wait_until(lambda: llm.health().stuck, 5, "the stuck flag")
        health = httpx.get(base + "/health")
        assert health.status_code == 503 and health.json()["executor"]["stuck"] is True
        assert httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 503
        llm.engine.step = step  # type: ignore[method-assign]
        release.set()
        wait_until(lambda: llm.health().ok, 5, "health back to ok")
        assert httpx.get(base + "/health").status_code == 200
    llm.close()


def test_metrics_and_health_agree_after_hostile_traffic(served: tuple[str, LLM]) -> None:
    base, _ = served
    health = httpx.get(base + "/health").json()
    assert health["kv_cache"]["kv_blocks_used"] >= 0 and json.dumps(health)
