"""Start the real HTTP server on a free loopback port inside a test."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from waiting import wait_until

from ifb.runtime.llm import LLM
from ifb.runtime.server import create_app

WORKER_START_S = 300  # upper bound for a grammar compile worker's start (importing xgrammar) on a loaded machine


def warm_compile_worker(llm: LLM) -> None:
    """Wait until the LLM's first grammar compile worker is up. It starts with the LLM, and a
    guided request before then waits for it (tens of seconds on a busy 2-core machine), so a
    test whose client timeouts are about its requests waits for this first."""
    pool = llm.frontend.grammar_compiler().pool
    wait_until(lambda: pool.num_ready, WORKER_START_S, "a warm grammar compile worker")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def running_server(llm: LLM, **app_options: Any) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(create_app(llm, **app_options), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until(
        lambda: httpx.get(base + "/health", timeout=5).status_code,
        60,
        "the server to answer /health",
        ignoring=(httpx.HTTPError,),
    )
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)
