"""Start the real HTTP server on a free loopback port inside a test."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from ifb.runtime.llm import LLM
from ifb.runtime.server import create_app


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
    deadline = time.time() + 20
    while True:
        try:
            httpx.get(base + "/health", timeout=1)
            break
        except httpx.HTTPError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)
