"""Servers the API tests share: the session's tiny Llama under a Qwen3-Thinking style chat template
(the prompt opens a think block unless `enable_thinking` is false), served plain and with the qwen3
reasoning parser, one of each per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import running_server, warm_compile_worker
from tiny_models import THINKING_TEMPLATE

from ifb import LLM
from ifb.runtime.reasoning import ReasoningParserKind


@pytest.fixture(scope="module")
def thinking_llm(tiny_llama_engine: Path) -> Iterator[LLM]:
    engine = LLM(tiny_llama_engine, max_batch_size=4, chat_template=THINKING_TEMPLATE)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def chat_server(thinking_llm: LLM) -> Iterator[str]:
    with running_server(thinking_llm, served_model_names=("tiny",)) as url:
        warm_compile_worker(thinking_llm)  # the guided requests' client timeouts are for them, not the start
        yield url


@pytest.fixture(scope="module")
def thinking_server(thinking_llm: LLM) -> Iterator[str]:
    parser = ReasoningParserKind.QWEN3
    with running_server(thinking_llm, served_model_names=("tiny",), reasoning_parser=parser) as url:
        warm_compile_worker(thinking_llm)
        yield url
