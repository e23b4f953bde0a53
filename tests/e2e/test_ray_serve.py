"""`ifb serve` on Ray Serve: two replicas of the tiny engine (one thread each) behind one ingress.

One Ray instance for the module: first a two-model application (the tiny Llama and Qwen2, one
replica each) is deployed and deleted, then one deployment serves the other tests (Ray and two
engines take ~20 s to start); the replica-kill test runs last. Skipped without the [serve] extra.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray.serve")

from server_harness import free_port  # noqa: E402
from waiting import scaled, wait_until  # noqa: E402

from ifb import LLM  # noqa: E402
from ifb.ray_serve.deploy import ServeOptions, serve_engine, serve_models, shutdown  # noqa: E402
from ifb.runtime.runtime_config import RuntimeSettings  # noqa: E402
from ifb.runtime.sampling_params import SamplingParams  # noqa: E402

START_TIMEOUT_S = 90
REPORT_WAIT_S = 10  # replicas report every 0.2 s here; allow for a busy 2-core machine
# waits poll the ingress's /health every 0.1 s (leaving the small machine to the replicas); a
# report not there yet or a replica restarting counts as "not yet"
POLL: dict[str, Any] = dict(ignoring=(httpx.HTTPError, KeyError, ValueError), every_s=0.1)


@pytest.fixture(scope="module")
def serve_port() -> Iterator[int]:
    """The port of the module's Serve instance (started by the first deployment), shut at the end."""
    try:
        yield free_port()
    finally:
        shutdown()


@pytest.fixture(scope="module")
def base_url(tiny_llama_engine: Path, serve_port: int) -> str:
    options = ServeOptions(num_replicas=2, threads_per_replica=1, port=serve_port, stats_period_s=0.2)
    serve_engine(tiny_llama_engine, RuntimeSettings(), options, blocking=False)
    base = f"http://127.0.0.1:{serve_port}"
    wait_until(lambda: health(base)["num_ready"] == 2, START_TIMEOUT_S, "both replicas ready", **POLL)
    return base


def test_several_models_route_by_the_body_model(
    tiny_llama_engine: Path, tiny_qwen2_engine: Path, serve_port: int
) -> None:
    """Two models, one replica deployment each: a request goes to the replicas of the model its
    body names (each answers with its own greedy text, under its name), an unknown model is the
    router's 404 naming the served ones, /v1/models lists both. Runs first: its two replicas take
    the CPUs the local instance has, and it deletes its application before the others deploy."""
    from ray import serve

    engines = {"llama": tiny_llama_engine, "qwen": tiny_qwen2_engine}
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    alone = {}
    for name, engine in engines.items():
        with LLM(engine) as llm:
            alone[name] = llm.generate(["hello there"], greedy)[0].text
    assert alone["llama"] != alone["qwen"]  # else a request answered by the wrong model would pass
    options = ServeOptions(num_replicas=1, threads_per_replica=1, port=serve_port, stats_period_s=0.2)
    serve_models(engines, RuntimeSettings(), options, blocking=False)
    base = f"http://127.0.0.1:{serve_port}"
    try:

        def listed() -> dict[str, str]:
            cards = httpx.get(base + "/v1/models", timeout=5).json()["data"]
            return {card["id"]: card["status"] for card in cards}

        wait_until(lambda: listed() == {"llama": "loaded", "qwen": "loaded"}, START_TIMEOUT_S, "both models", **POLL)
        for name in engines:
            body = {"model": name, "prompt": "hello there", "max_tokens": 8, "temperature": 0}
            response = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            assert (response.json()["model"], response.json()["choices"][0]["text"]) == (name, alone[name])
        unknown = httpx.post(base + "/v1/completions", json={"model": "gpt-4o", "prompt": "hi"}, timeout=30)
        assert unknown.status_code == 404
        error = unknown.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        assert "'gpt-4o'" in error["message"] and "llama, qwen" in error["message"]
    finally:
        serve.delete("ifb-models")


def health(base: str) -> dict[str, Any]:
    return httpx.get(base + "/health", timeout=5).json()


def per_replica(base: str, block: str, key: str) -> dict[str, int]:
    return {name: r[block][key] for name, r in health(base)["replicas"].items() if block in r}


def complete(base: str, prompt: list[int], max_tokens: int = 4, **extra: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, **extra}
    return httpx.post(base + "/v1/completions", json=body, timeout=60)


def test_openai_sdk_works_unchanged(base_url: str) -> None:
    """The openai client talks to the ingress as to `ifb run`: models, completions, chat, streaming."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt="hello there", max_tokens=5)
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens >= 1
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.completions.create(model=model, prompt="stream me", max_tokens=6, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=5, temperature=-1)


def test_shared_prefix_requests_land_on_one_replica(base_url: str) -> None:
    """Prompts sharing their first blocks go to the replica that holds them: prefix hits rise
    on that replica only."""
    before = per_replica(base_url, "kv_cache", "prefix_cache_hit_tokens")
    shared = [7 + (i * 13) % 250 for i in range(64)]  # 4 full blocks of 16
    for i in range(5):
        assert complete(base_url, shared + [11 + i, 12, 13]).status_code == 200

    def gained() -> dict[str, int]:
        after = per_replica(base_url, "kv_cache", "prefix_cache_hit_tokens")
        return {name: after[name] - before.get(name, 0) for name in after}

    wait_until(lambda: sum(gained().values()) >= 4 * 64, REPORT_WAIT_S, "prefix hits reported", **POLL)
    assert sorted(gained().values()) == [0, 4 * 64]


def test_load_spreads_when_prefixes_differ(base_url: str) -> None:
    """Concurrent requests with unrelated prompts go to both replicas (power of two choices)."""

    def idle_everywhere() -> bool:  # reported loads are up to a report period old: start from idle
        reported = health(base_url)["replicas"].values()
        return all(r["scheduling"]["resident"] + r["scheduling"]["queued"] == 0 for r in reported if "scheduling" in r)

    wait_until(idle_everywhere, REPORT_WAIT_S, "idle replicas", **POLL)
    before = per_replica(base_url, "scheduling", "submitted")
    prompts = [[30 + 17 * i + j for j in range(20)] for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(lambda p: complete(base_url, p, max_tokens=24, ignore_eos=True).status_code, prompts))
    assert codes == [200] * 12

    def gained() -> list[int]:
        after = per_replica(base_url, "scheduling", "submitted")
        return [after[name] - before.get(name, 0) for name in after]

    wait_until(lambda: sum(gained()) >= 12, REPORT_WAIT_S, "submissions reported", **POLL)
    assert min(gained()) >= 2, gained()
    in_flight = [r["router_in_flight"] for r in health(base_url)["replicas"].values()]
    assert in_flight == [0, 0], "the router counts every finished request out"


def test_client_disconnect_cancels_inside_the_replica(base_url: str) -> None:
    """Closing a stream mid-way aborts the request in the replica that ran it: that replica's
    `cancelled` rises by exactly one, its resident count returns to 0, and nothing completed."""

    def settled() -> dict[str, dict[str, int]] | None:
        """Each replica's scheduling block, once every report shows all its requests ended."""
        blocks = {name: r["scheduling"] for name, r in health(base_url)["replicas"].items() if "scheduling" in r}
        for b in blocks.values():
            if b["resident"] or b["queued"] or b["submitted"] != b["completed"] + b["cancelled"] + b["failed"]:
                return None
        return blocks if len(blocks) == 2 else None

    before = wait_until(settled, REPORT_WAIT_S, "reports with every earlier request ended", **POLL)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3:
                break

    def rise(after: dict[str, dict[str, int]], key: str) -> dict[str, int]:
        return {name: after[name][key] - before[name][key] for name in before}

    def ended() -> dict[str, dict[str, int]] | None:
        now = settled()
        return now if now is not None and sum(rise(now, "submitted").values()) == 1 else None

    after = wait_until(ended, REPORT_WAIT_S, "the request reported ended", **POLL)
    assert sorted(rise(after, "cancelled").values()) == [0, 1], rise(after, "cancelled")
    assert rise(after, "submitted") == rise(after, "cancelled"), "cancelled on the replica that ran it"
    assert set(rise(after, "completed").values()) == {0} and set(rise(after, "failed").values()) == {0}


def _stream_outcome(base: str, prompt: list[int]) -> str:
    """'done', 'error' (an error event, or a failed status), read to the end."""
    body = {"prompt": prompt, "max_tokens": 220, "ignore_eos": True, "stream": True}
    outcome = "done"
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
        if response.status_code != 200:
            return "error"
        for line in response.iter_lines():
            if line.startswith("data: {") and '"error"' in line and json.loads(line[6:]).get("error"):
                outcome = "error"
    return outcome


def test_killed_replica_fails_only_its_requests_and_is_replaced(base_url: str) -> None:
    """SIGKILL one replica's process mid-stream: its streams end with an error event, the other
    replica's finish, nothing hangs, new requests succeed, and Ray starts a replacement."""
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_stream_outcome, base_url, [40 + 9 * i + j for j in range(20)]) for i in range(6)]
        wait_until(
            lambda: min(per_replica(base_url, "scheduling", "resident").values()) > 0, 20, "both replicas busy", **POLL
        )
        victim, report = next(iter(sorted(health(base_url)["replicas"].items())))
        os.kill(report["pid"], signal.SIGKILL)
        outcomes = [f.result(timeout=scaled(90)) for f in futures]
    assert "error" in outcomes and "done" in outcomes, outcomes
    for i in range(4):
        assert complete(base_url, [90 + i, 91, 92]).status_code == 200

    def replaced() -> bool:
        replicas = health(base_url)["replicas"]
        ready = [r for r in replicas.values() if r.get("status") == "ok"]
        return victim not in replicas and len(ready) == 2

    wait_until(replaced, 60, "a replacement replica", **POLL)
