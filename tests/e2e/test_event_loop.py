"""The server's event loop never waits on tokenization or a grammar compile: while a compile and
a tokenization are both in progress (each held until the test lets it go), another client's
stream runs to its end and /health answers. Were either call run on the loop, the other could
not even start, and the stream could not move."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from server_harness import running_server
from waiting import StepGate, wait_until

from ifb import LLM

HOLD_S = 120  # upper bound on how long a held call waits for the test to release it


class HeldFrontend:
    """A compile, and a tokenization of a marked prompt, each wait for `release` (stand-ins for
    a deep schema and a multi-megabyte prompt, measured at 10 s and 2.3 s on the default engine)."""

    def __init__(self, llm: LLM) -> None:
        self.compiling = threading.Event()
        self.tokenizing = threading.Event()
        self.release = threading.Event()
        compiler = llm.frontend.grammar_compiler()
        compile_guide = compiler.compile
        tokenize = llm.frontend.tokenize

        def held_compile(guide):  # type: ignore[no-untyped-def]
            self.compiling.set()
            self.release.wait(HOLD_S)
            return compile_guide(guide)

        def held_tokenize(prompt):  # type: ignore[no-untyped-def]
            if isinstance(prompt, str) and prompt.startswith("SLOW"):
                self.tokenizing.set()
                self.release.wait(HOLD_S)
            return tokenize(prompt)

        compiler.compile = held_compile  # type: ignore[method-assign]
        llm.frontend.tokenize = held_tokenize  # type: ignore[method-assign]

    def both_in_progress(self) -> bool:
        return self.compiling.is_set() and self.tokenizing.is_set()


def test_slow_compile_and_tokenization_do_not_stall_other_streams(tiny_llama_engine: Path) -> None:
    llm = LLM(tiny_llama_engine, max_batch_size=4)
    frontend = HeldFrontend(llm)
    lines: list[str] = []
    stream_ended = threading.Event()
    statuses: list[int] = []  # each slow request's, once released
    with running_server(llm) as base, StepGate(llm.executor) as gate:
        # the stream takes its first step, then waits for both slow calls to be in progress, so
        # it is still running while they are
        gate.allow = lambda batch: gate.first_steps_only(batch) or frontend.both_in_progress()
        body = {"prompt": [5, 6, 7], "max_tokens": 120, "temperature": 0, "ignore_eos": True, "stream": True}

        def read_stream() -> None:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                lines.extend(line for line in response.iter_lines() if line)
            stream_ended.set()

        def post(payload: dict) -> None:
            statuses.append(httpx.post(base + "/v1/completions", json=payload, timeout=HOLD_S).status_code)

        reader = threading.Thread(target=read_stream)
        reader.start()
        wait_until(lambda: gate.steps, 30, "the stream's first step")
        guided = {"prompt": [5], "max_tokens": 4, "guided_choice": ["yes", "no"]}
        big = {"prompt": "SLOW " + "word " * 1000, "max_tokens": 2}
        posts = [threading.Thread(target=post, args=(b,)) for b in (guided, big)]
        for p in posts:
            p.start()
        try:
            wait_until(frontend.both_in_progress, 30, "the compile and the tokenization to be in progress together")
            wait_until(stream_ended.is_set, 60, "the stream to end while both are in progress")
            assert httpx.get(base + "/health", timeout=30).status_code == 200  # both still held
        finally:
            frontend.release.set()
            for p in posts:
                p.join(HOLD_S)
            reader.join(60)
    llm.close()
    assert lines[-1] == "data: [DONE]" and len([line for line in lines if line.startswith("data: {")]) >= 120
    assert sorted(statuses) == [200, 400]  # guided: served; the big prompt: longer than max_seq_len
