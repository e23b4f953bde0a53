"""Reasoning at the HTTP API on the tiny model: `chat_template_kwargs` reach the chat template, and
`--reasoning-parser qwen3` returns the `<think>` part as `reasoning_content`, streamed or not.

The template below opens a think block in the prompt unless `enable_thinking` is false (as
Qwen3-Thinking templates do), so the kwarg shows in the prompt's token count and in where the
parser starts. A random model never writes `<think>` itself, so the split of a reply that opens
a block is driven by a guided regex that spells one out."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from server_harness import running_server

from ifb import LLM

HI = [{"role": "user", "content": "hi"}]
NO_THINKING = {"enable_thinking": False}
SPELLED = {"guided_regex": "<think>abc</think>xyz", "max_tokens": 64}  # the tiny tokenizer spells it


def chat(base: str, **body: Any) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"messages": HI, **body}, timeout=60)


def test_chat_template_kwargs_reach_the_template(thinking_server: str, thinking_llm: LLM) -> None:
    thinking, plain = (
        thinking_llm.apply_chat_template(HI),
        thinking_llm.apply_chat_template(HI, chat_template_kwargs=NO_THINKING),
    )
    assert thinking_llm.detokenize(plain).endswith("<think></think>") and len(plain) > len(thinking)
    body = {"max_tokens": 2, "chat_template_kwargs": NO_THINKING}
    assert chat(thinking_server, **body).json()["usage"]["prompt_tokens"] == len(plain)
    assert chat(thinking_server, max_tokens=2).json()["usage"]["prompt_tokens"] == len(thinking)
    tokens = httpx.post(
        thinking_server + "/tokenize", json={"messages": HI, "chat_template_kwargs": NO_THINKING}
    ).json()
    assert tokens["tokens"] == plain


def test_a_block_the_prompt_opened_makes_the_reply_reasoning(thinking_server: str) -> None:
    """Thinking on: the template opened `<think>`, so the (tag-free) random reply is reasoning;
    off: the template closed the block, so the reply is content."""
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    thinking = chat(thinking_server, **common).json()["choices"][0]["message"]
    assert thinking["reasoning_content"] and thinking["content"] is None
    plain = chat(thinking_server, **common, chat_template_kwargs=NO_THINKING).json()["choices"][0]["message"]
    assert plain["content"] and "reasoning_content" not in plain


def test_a_reply_that_opens_a_block_is_split(thinking_server: str) -> None:
    message = chat(thinking_server, **SPELLED, chat_template_kwargs=NO_THINKING).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("abc", "xyz")


def test_streamed_reasoning_comes_first_then_content(thinking_server: str) -> None:
    """Through the SDK, token by token: the tags are cut across deltas and never shown."""
    client = openai.OpenAI(base_url=thinking_server + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model="tiny",
        messages=HI,  # type: ignore[arg-type]
        stream=True,
        extra_body={**SPELLED, "chat_template_kwargs": NO_THINKING},
    )
    parts = []
    for chunk in stream:
        for choice in chunk.choices:
            reasoning = getattr(choice.delta, "reasoning_content", None)
            parts += [("reasoning", reasoning)] if reasoning else []
            parts += [("content", choice.delta.content)] if choice.delta.content else []
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, reverse=True) and len(parts) > 2  # reasoning deltas, then content ones
    assert "".join(t for k, t in parts if k == "reasoning") == "abc"
    assert "".join(t for k, t in parts if k == "content") == "xyz"


def test_without_a_parser_the_reply_is_content_as_generated(thinking_llm: LLM) -> None:
    with running_server(thinking_llm) as base:
        message = chat(base, **SPELLED).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>abc</think>xyz"}


@pytest.mark.parametrize("kwargs", ["yes", [1], {"tokenize": False}, {"messages": []}])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(thinking_server: str, kwargs: Any) -> None:
    for response in (
        chat(thinking_server, max_tokens=1, chat_template_kwargs=kwargs),
        httpx.post(thinking_server + "/tokenize", json={"messages": HI, "chat_template_kwargs": kwargs}),
    ):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs"


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_a_reasoning_budget_closes_the_block_after_its_tokens(thinking_server: str) -> None:
    """The template opened <think>; with 3 tokens to think, the reply's reasoning is its first 3
    tokens (as a 3-token reply shows), then the forced `</think>`, then content to max_tokens."""
    first_three = chat(thinking_server, max_tokens=3, **GREEDY).json()["choices"][0]["message"]
    assert first_three["content"] is None
    for name in ("max_reasoning_tokens", "thinking_budget"):
        reply = chat(thinking_server, max_tokens=24, **GREEDY, **{name: 3}).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] == first_three["reasoning_content"]
        assert message["content"] and reply["usage"]["completion_tokens"] == 24
    unbounded = chat(thinking_server, max_tokens=24, **GREEDY).json()["choices"][0]["message"]
    assert unbounded["content"] is None  # without the budget the random model never closes it


def test_a_streamed_reply_keeps_its_budget(thinking_server: str) -> None:
    client = openai.OpenAI(base_url=thinking_server + "/v1", api_key="none")
    whole = chat(thinking_server, max_tokens=16, max_reasoning_tokens=2, **GREEDY).json()["choices"][0]["message"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=HI,  # type: ignore[arg-type]
        stream=True,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "max_reasoning_tokens": 2},
    )
    reasoning, content = "", ""
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])


def test_a_budget_of_zero_skips_thinking(thinking_server: str) -> None:
    message = chat(thinking_server, max_tokens=8, max_reasoning_tokens=0, **GREEDY).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
        ({"max_reasoning_tokens": 2, "thinking_budget": 2}, "thinking_budget"),
    ],
)
def test_bad_budgets_are_a_400_naming_the_field(thinking_server: str, body: dict[str, Any], field: str) -> None:
    response = chat(thinking_server, max_tokens=4, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_a_budget_needs_a_reasoning_parser(thinking_llm: LLM) -> None:
    with running_server(thinking_llm) as base:
        response = chat(base, max_tokens=4, thinking_budget=2)
    assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_budget"
