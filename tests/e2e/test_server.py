"""The HTTP server, started for real on loopback, driven by httpx and the official openai client."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import running_server
from waiting import StepGate, wait_until

from ifb import LLM, SamplingParams
from ifb.runtime.scheduler import ScheduledBatch


@pytest.fixture(scope="module")
def server(tiny_llama_engine: Path) -> Iterator[tuple[str, LLM]]:
    llm = LLM(tiny_llama_engine, max_batch_size=4, max_queued_requests=4)
    with running_server(llm) as base:
        yield base, llm
    llm.close()


def wait_idle(base: str, ended: int = 0) -> dict:
    """/health once nothing is resident or queued and at least `ended` requests have ended
    (completed, cancelled or failed) in total."""

    def idle() -> dict | None:
        health = httpx.get(base + "/health").json()
        s = health["scheduling"]
        done = s["completed"] + s["cancelled"] + s["failed"]
        return health if s["resident"] == 0 and s["queued"] == 0 and done >= ended else None

    return wait_until(idle, 30, "an idle server")


def test_streaming_equals_non_streaming_equals_python_api(server: tuple[str, LLM]) -> None:
    base, llm = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    model = client.models.list().data[0].id
    common = dict(model=model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(prompt="hello world", **common)
    streamed = "".join(
        chunk.choices[0].text for chunk in client.completions.create(prompt="hello world", stream=True, **common)
    )
    direct = llm.generate("hello world", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert plain.choices[0].text == streamed == direct.text
    assert plain.usage.completion_tokens == 12 and plain.choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "paged attention"}]
    chat = client.chat.completions.create(messages=messages, **common)
    chat_stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **common
    )
    chunks = list(chat_stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_concurrent_clients_share_batches(server: tuple[str, LLM]) -> None:
    """Three clients arriving while a first one runs join its batch mid-flight: the first one's
    second step waits until all four reached the executor."""
    base, llm = server
    before = httpx.get(base + "/health").json()["scheduling"]["admitted_mid_flight"]
    results = []

    def call(i: int) -> None:
        r = httpx.post(
            base + "/v1/completions",
            json={"prompt": [5 + i, 6], "max_tokens": 30 + i, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        results.append(r.status_code)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    with StepGate(llm.executor) as gate:
        gate.allow = lambda batch: gate.first_steps_only(batch) or len(gate.submitted) >= 4
        threads[0].start()
        wait_until(lambda: gate.steps, 30, "the first request's first step")
        for t in threads[1:]:
            t.start()
        for t in threads:
            t.join()
    assert results == [200] * 4 and max(gate.batch_sizes) == 4
    assert httpx.get(base + "/health").json()["scheduling"]["admitted_mid_flight"] == before + 3


def test_429_at_the_exact_limit_and_disconnect_frees_everything(tiny_llama_engine: Path) -> None:
    """2 seats + 2 queue slots: 4 held streams fill the server and the 5th gets 429 without waiting
    for a seat (none can free: a started request moves on only beside a newcomer's first step until
    its client has gone); disconnecting all 4 cancels each of them and returns every seat and block."""
    llm = LLM(tiny_llama_engine, max_batch_size=2, max_queued_requests=2)
    with running_server(llm) as base, StepGate(llm.executor) as gate:
        # the two seated ones start together (the first waits for the second), then run on only
        # once their clients have gone
        gate.allow = lambda batch: len(gate.submitted) >= 2 and gate.newcomer_or_aborted(batch)
        body = {"prompt": [7, 8], "max_tokens": 240, "temperature": 0, "ignore_eos": True, "stream": True}
        clients = [httpx.Client(timeout=30) for _ in range(4)]

        def post_quietly(client: httpx.Client) -> None:
            try:
                client.post(base + "/v1/completions", json=body)
            except httpx.HTTPError:
                pass  # closed by the test on purpose

        opened = [threading.Thread(target=post_quietly, args=(c,), daemon=True) for c in clients[2:]]
        streams = [c.stream("POST", base + "/v1/completions", json=body) for c in clients[:2]]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # headers come with the first token
            responses = list(pool.map(lambda s: s.__enter__(), streams))
        for t in opened:  # the queued two: their headers come only once they get a seat
            t.start()
        wait_until(lambda: len(gate.submitted) == 4, 30, "4 requests inside the engine")
        try:
            assert all(r.status_code == 200 for r in responses)
            refused = httpx.post(base + "/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=30)
            assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
            assert "full" in refused.json()["error"]["message"]
        finally:
            for s in streams:
                s.__exit__(None, None, None)
            for c in clients:
                c.close()
        health = wait_idle(base, ended=4)
        assert health["kv_cache"]["kv_blocks_used"] == 0
        assert health["scheduling"]["cancelled"] == 4 and health["scheduling"]["refused"] == 1
        assert health["scheduling"]["completed"] == 0
    llm.close()


QUEUE_TIMEOUT_S = 0.3


def test_queue_timeout_returns_429(tiny_llama_engine: Path) -> None:
    """One seat, held: a request that waits in the queue past the timeout gets a 429. The holder's
    steps wait until the late request has waited that long, so the seat cannot free first."""
    llm = LLM(tiny_llama_engine, max_batch_size=1, max_queued_requests=2, queue_timeout=QUEUE_TIMEOUT_S)
    with running_server(llm) as base, StepGate(llm.executor) as gate:

        def late_one_waited_out(batch: ScheduledBatch) -> bool:
            arrivals = [r.times.arrival for r in gate.submitted.values()][1:]
            return bool(arrivals) and time.perf_counter() - arrivals[0] > QUEUE_TIMEOUT_S

        gate.allow = lambda batch: gate.first_steps_only(batch) or late_one_waited_out(batch)
        with (
            httpx.Client(timeout=30) as holder,
            holder.stream(
                "POST",
                base + "/v1/completions",
                json={"prompt": [5], "max_tokens": 250, "ignore_eos": True, "stream": True},
            ) as held,
        ):
            lines = held.iter_lines()  # keep the iterator: dropping it closes the stream
            next(lines)
            late = httpx.post(base + "/v1/completions", json={"prompt": [6], "max_tokens": 3}, timeout=30)
            assert late.status_code == 429 and "queue timeout" in late.json()["error"]["message"]
        health = wait_idle(base, ended=1)  # the holder, cancelled when its stream closed
        assert health["scheduling"]["refused"] == 1 and health["scheduling"]["cancelled"] == 1
    llm.close()


def test_queue_timeout_times_the_queue_not_the_first_token(tiny_llama_engine: Path) -> None:
    """Admitted at once but slow to its first token (its first step waits until the request is
    older than the queue timeout, like a long prefill): not a 429."""
    llm = LLM(tiny_llama_engine, max_batch_size=2, queue_timeout=0.2)
    with running_server(llm) as base, StepGate(llm.executor) as gate:

        def older_than_the_timeout(batch: ScheduledBatch) -> bool:
            requests = [gate.submitted.get(item.request_id) for item in batch.requests]
            return all(r is not None and time.perf_counter() - r.times.arrival > 0.2 for r in requests)

        gate.allow = older_than_the_timeout
        response = httpx.post(base + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    llm.close()


BAD_INPUTS = [
    (b"{not json", "body", 400),
    (json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), "max_tokens", 400),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens", 400),
    (json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), "max_tokens", 400),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature", 400),
    (json.dumps({"prompt": "hi", "temperature": -0.5}).encode(), "temperature", 400),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), "top_p", 400),
    (json.dumps({"prompt": "hi", "top_p": 1.5}).encode(), "top_p", 400),
    (json.dumps({"prompt": [5] * 200, "max_tokens": 100}).encode(), "max_tokens", 400),
    (json.dumps({"prompt": "", "max_tokens": 5}).encode(), "prompt", 400),
    (json.dumps({"prompt": "hi", "frobnicate": 1}).encode(), "frobnicate", 400),
    (b'{"prompt": "\xff\xfe"}', "body", 400),
    (json.dumps({"prompt": "hi", "model": "gpt-17"}).encode(), "model", 404),
]


@pytest.mark.parametrize("raw,field,status", BAD_INPUTS)
def test_bad_input_names_its_field(server: tuple[str, LLM], raw: bytes, field: str, status: int) -> None:
    base, _ = server
    response = httpx.post(base + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_chunked_body_over_the_limit_is_413(server: tuple[str, LLM]) -> None:
    """No Content-Length (chunked transfer): the limit holds on the bytes received."""
    base, _ = server

    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"prompt": "'
        for _ in range(6):
            yield b"a" * (1 << 20)
        yield b'", "max_tokens": 1}'

    response = httpx.post(base + "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "limit" in response.json()["error"]["message"]
    assert httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 200


def test_oversized_body_is_413(server: tuple[str, LLM]) -> None:
    base, _ = server
    response = httpx.post(
        base + "/v1/completions", content=b"x" * (5 << 20), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413


def test_api_key_guards_every_route_but_liveness(tiny_llama_engine: Path) -> None:
    """With a key: /v1/*, /health, /metrics and the API docs all need it; /health/live does not."""
    llm = LLM(tiny_llama_engine)
    key = {"Authorization": "Bearer sekret"}
    with running_server(llm, api_key="sekret") as base:
        for path in ("/v1/models", "/health", "/metrics"):
            assert httpx.get(base + path).status_code == 401, path
            assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
            assert httpx.get(base + path, headers=key).status_code == 200, path
        assert httpx.get(base + "/openapi.json", headers=key).status_code == 404  # no schema to probe
        assert httpx.get(base + "/health/live").json() == {"status": "alive"}
        client = openai.OpenAI(base_url=base + "/v1", api_key="sekret")
        assert client.completions.create(model=llm.model_name, prompt="hi", max_tokens=2).choices
    llm.close()


def test_metrics_parse_and_move(server: tuple[str, LLM]) -> None:
    base, _ = server

    def scrape() -> dict[str, float]:
        text = httpx.get(base + "/metrics").text
        return {s.name + str(s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = scrape()
    httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}, timeout=30)
    after = scrape()
    assert after["ifb:generation_tokens_total{}"] >= before.get("ifb:generation_tokens_total{}", 0) + 3
    assert after["ifb:time_to_first_token_seconds_count{}"] > before.get("ifb:time_to_first_token_seconds_count{}", 0)
    assert after["ifb:request_success_total{'finished_reason': 'length'}"] >= 1
    assert "ifb:kv_cache_usage_perc{}" in after and "ifb:num_requests_running{}" in after


def test_health_is_503_when_the_executor_is_dead(tiny_llama_engine: Path) -> None:
    llm = LLM(tiny_llama_engine)
    with running_server(llm) as base:
        assert httpx.get(base + "/health").status_code == 200
        llm.executor.shutdown()
        response = httpx.get(base + "/health")
        assert response.status_code == 503 and response.json()["executor"]["alive"] is False
    llm.close()


def test_non_streaming_disconnect_cancels_inside_the_engine(tiny_llama_engine: Path) -> None:
    """A non-streaming client that gives up: its request is cancelled inside the engine. The
    request takes no second step before its abort arrives, so it cannot finish first."""
    llm = LLM(tiny_llama_engine)
    with running_server(llm) as base, StepGate(llm.executor) as gate:
        gate.allow = gate.newcomer_or_aborted
        with pytest.raises(httpx.ReadTimeout):  # the client gives up: no response can come
            httpx.post(
                base + "/v1/completions",
                json={"prompt": [5], "max_tokens": 240, "ignore_eos": True},
                timeout=httpx.Timeout(30, read=0.5),
            )
        health = wait_idle(base, ended=1)
        assert health["scheduling"]["cancelled"] == 1 and health["scheduling"]["completed"] == 0
        assert health["kv_cache"]["kv_blocks_used"] == 0
    llm.close()
