"""Schemathesis drives the server's own OpenAPI schema with generated requests: none may get a
5xx or hang, and afterwards nothing is left running and no KV block is leaked.

Rerun with more examples: `IFB_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/e2e/test_fuzz_server.py`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from server_harness import warm_compile_worker
from waiting import wait_until

from ifb import LLM
from ifb.runtime.server import create_app

EXAMPLES = int(os.environ.get("IFB_FUZZ_EXAMPLES", "400"))  # per operation: ~1,300 POSTs, ~650 reach the engine


@pytest.fixture(scope="module")
def fuzzed_llm(tiny_llama_engine: Path) -> Iterator[LLM]:
    llm = LLM(tiny_llama_engine, max_batch_size=4, max_queued_requests=4, default_max_tokens=16)
    warm_compile_worker(llm)  # a guided case's 30 s client timeout is for it, not the worker's start
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def api_schema(fuzzed_llm: LLM) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(fuzzed_llm))


def test_no_generated_request_gets_a_5xx(api_schema: schemathesis.BaseSchema) -> None:
    """Every operation in the schema, EXAMPLES generated requests each (schemathesis' pytest
    plugin does not run on this pytest, so its strategies are driven by hypothesis here)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def no_5xx(case: schemathesis.Case) -> None:
            response = case.call(timeout=30)
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code}: {response.text[:500]}"
            )

        no_5xx()


def test_fuzzing_left_nothing_behind(fuzzed_llm: LLM) -> None:
    """Runs after the fuzz cases (same module): every request ended and gave its blocks back."""
    wait_until(
        lambda: fuzzed_llm.stats().num_running == 0 and fuzzed_llm.stats().num_waiting == 0, 30, "an idle engine"
    )
    snapshot = fuzzed_llm.stats()
    assert snapshot.kv.num_used_blocks == 0
    assert (
        snapshot.counters.submitted
        == snapshot.counters.completed + snapshot.counters.cancelled + snapshot.counters.failed
    )
    assert fuzzed_llm.health().ok
