"""Reasoning at the HTTP API on the tiny model: `chat_template_kwargs` reach the chat template, and
`--reasoning-parser qwen3` returns the `<think>` part as `reasoning_content`, streamed or not.

The template below opens a think block in the prompt unless `enable_thinking` is false (as
Qwen3-Thinking templates do), so the kwarg shows in the prompt's token count and in where the
parser starts. A random model never writes `<think>` itself, so the split of a reply that opens
a block is driven by a guided regex that spells one out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import running_server, warm_compile_worker
from tiny_models import CHAT_TEMPLATE

from ifb import LLM
from ifb.runtime.reasoning import ReasoningParserKind

THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|assistant|>",
    "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>"
    "{% else %}<think>{% endif %}",
)
HI = [{"role": "user", "content": "hi"}]
NO_THINKING = {"enable_thinking": False}
SPELLED = {"guided_regex": "<think>abc</think>xyz", "max_tokens": 64}  # the tiny tokenizer spells it


@pytest.fixture(scope="module")
def llm(tiny_llama_engine: Path) -> Iterator[LLM]:
    engine = LLM(tiny_llama_engine, max_batch_size=4, chat_template=THINKING_TEMPLATE)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def qwen3(llm: LLM) -> Iterator[str]:
    with running_server(llm, reasoning_parser=ReasoningParserKind.QWEN3, served_model_names=("tiny",)) as base:
        warm_compile_worker(llm)  # the guided requests' client timeouts are for them, not the start
        yield base


def chat(base: str, **body: Any) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json={"messages": HI, **body}, timeout=60)


def test_chat_template_kwargs_reach_the_template(qwen3: str, llm: LLM) -> None:
    thinking, plain = llm.apply_chat_template(HI), llm.apply_chat_template(HI, chat_template_kwargs=NO_THINKING)
    assert llm.detokenize(plain).endswith("<think></think>") and len(plain) > len(thinking)
    body = {"max_tokens": 2, "chat_template_kwargs": NO_THINKING}
    assert chat(qwen3, **body).json()["usage"]["prompt_tokens"] == len(plain)
    assert chat(qwen3, max_tokens=2).json()["usage"]["prompt_tokens"] == len(thinking)
    tokens = httpx.post(qwen3 + "/tokenize", json={"messages": HI, "chat_template_kwargs": NO_THINKING}).json()
    assert tokens["tokens"] == plain


def test_a_block_the_prompt_opened_makes_the_reply_reasoning(qwen3: str) -> None:
    """Thinking on: the template opened `<think>`, so the (tag-free) random reply is reasoning;
    off: the template closed the block, so the reply is content."""
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    thinking = chat(qwen3, **common).json()["choices"][0]["message"]
    assert thinking["reasoning_content"] and thinking["content"] is None
    plain = chat(qwen3, **common, chat_template_kwargs=NO_THINKING).json()["choices"][0]["message"]
    assert plain["content"] and "reasoning_content" not in plain


def test_a_reply_that_opens_a_block_is_split(qwen3: str) -> None:
    message = chat(qwen3, **SPELLED, chat_template_kwargs=NO_THINKING).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("abc", "xyz")


def test_streamed_reasoning_comes_first_then_content(qwen3: str) -> None:
    """Through the SDK, token by token: the tags are cut across deltas and never shown."""
    client = openai.OpenAI(base_url=qwen3 + "/v1", api_key="none")
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


def test_without_a_parser_the_reply_is_content_as_generated(llm: LLM) -> None:
    with running_server(llm) as base:
        message = chat(base, **SPELLED).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "<think>abc</think>xyz"}


@pytest.mark.parametrize("kwargs", ["yes", [1], {"tokenize": False}, {"messages": []}])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(qwen3: str, kwargs: Any) -> None:
    for response in (
        chat(qwen3, max_tokens=1, chat_template_kwargs=kwargs),
        httpx.post(qwen3 + "/tokenize", json={"messages": HI, "chat_template_kwargs": kwargs}),
    ):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs"


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_a_reasoning_budget_closes_the_block_after_its_tokens(qwen3: str) -> None:
    """The template opened <think>; with 3 tokens to think, the reply's reasoning is its first 3
    tokens (as a 3-token reply shows), then the forced `</think>`, then content to max_tokens."""
    first_three = chat(qwen3, max_tokens=3, **GREEDY).json()["choices"][0]["message"]
    assert first_three["content"] is None
    for name in ("max_reasoning_tokens", "thinking_budget"):
        reply = chat(qwen3, max_tokens=24, **GREEDY, **{name: 3}).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] == first_three["reasoning_content"]
        assert message["content"] and reply["usage"]["completion_tokens"] == 24
    unbounded = chat(qwen3, max_tokens=24, **GREEDY).json()["choices"][0]["message"]
    assert unbounded["content"] is None  # without the budget the random model never closes it


def test_a_streamed_reply_keeps_its_budget(qwen3: str) -> None:
    client = openai.OpenAI(base_url=qwen3 + "/v1", api_key="none")
    whole = chat(qwen3, max_tokens=16, max_reasoning_tokens=2, **GREEDY).json()["choices"][0]["message"]
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


def test_a_budget_of_zero_skips_thinking(qwen3: str) -> None:
    message = chat(qwen3, max_tokens=8, max_reasoning_tokens=0, **GREEDY).json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
        ({"max_reasoning_tokens": 2, "thinking_budget": 2}, "thinking_budget"),
    ],
)
def test_bad_budgets_are_a_400_naming_the_field(qwen3: str, body: dict[str, Any], field: str) -> None:
    response = chat(qwen3, max_tokens=4, **body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_a_budget_needs_a_reasoning_parser(llm: LLM) -> None:
    with running_server(llm) as base:
        response = chat(base, max_tokens=4, thinking_budget=2)
    assert response.status_code == 400 and response.json()["error"]["param"] == "thinking_budget"
