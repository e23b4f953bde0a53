"""The server's event loop never waits on tokenization or a grammar compile: while a slow
compile and a slow tokenization run, another client's stream keeps its inter-token gaps near
the step time and /health answers at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from server_harness import running_server

from ifb import LLM

STALL_S = 2.0  # what each slow call takes: the loop would freeze this long if it ran it


def make_frontend_slow(llm: LLM) -> None:
    """A compile and a tokenization of a marked prompt each take STALL_S (stand-ins for a deep
    schema and a multi-megabyte prompt, measured at 10 s and 2.3 s on the default engine)."""
    compiler = llm.frontend.grammar_compiler()
    compile_guide = compiler.compile
    tokenize = llm.frontend.tokenize

    def slow_compile(guide, timeout_s=10.0):  # type: ignore[no-untyped-def]
        time.sleep(STALL_S)
        return compile_guide(guide, timeout_s)

    def slow_tokenize(prompt):  # type: ignore[no-untyped-def]
        if isinstance(prompt, str) and prompt.startswith("SLOW"):
            time.sleep(STALL_S)
        return tokenize(prompt)

    compiler.compile = slow_compile  # type: ignore[method-assign]
    llm.frontend.tokenize = slow_tokenize  # type: ignore[method-assign]


def test_slow_compile_and_tokenization_do_not_stall_other_streams(tiny_llama_engine: Path) -> None:
    llm = LLM(tiny_llama_engine, max_batch_size=4)
    make_frontend_slow(llm)
    arrivals: list[float] = []
    with running_server(llm) as base:
        body = {"prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}

        def read_stream() -> None:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        arrivals.append(time.monotonic())

        reader = threading.Thread(target=read_stream)
        reader.start()
        while len(arrivals) < 5:
            time.sleep(0.01)
        slow_started = time.monotonic()
        guided = {"prompt": [5], "max_tokens": 4, "guided_choice": ["yes", "no"]}
        big = {"prompt": "SLOW " + "word " * 1000, "max_tokens": 2}
        posts = [
            threading.Thread(target=httpx.post, args=(base + "/v1/completions",), kwargs={"json": b, "timeout": 60})
            for b in (guided, big)
        ]
        for post in posts:
            post.start()
        health_latencies = []
        while time.monotonic() - slow_started < STALL_S:
            t = time.monotonic()
            assert httpx.get(base + "/health", timeout=10).status_code == 200
            health_latencies.append(time.monotonic() - t)
            time.sleep(0.1)
        for post in posts:
            post.join(60)
        reader.join(60)
    llm.close()
    during = [
        b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if a >= slow_started and b <= slow_started + STALL_S
    ]
    assert len(during) >= 5, "the stream must keep producing while the slow calls run"
    assert max(during) < STALL_S / 4, f"a token waited {max(during):.2f}s behind frontend work"
    assert max(health_latencies) < STALL_S / 4
