"""A bounded burst over loopback with half the clients abandoning mid-stream: afterwards nothing
runs, nothing waits, and every KV block is back in the pool."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from greedy_loop import wait_until
from server_harness import running_server

from ifb import LLM

CLIENTS = 24


def test_burst_with_abandoning_clients_leaks_nothing(tiny_llama_engine: Path) -> None:
    llm = LLM(tiny_llama_engine, max_batch_size=8, max_queued_requests=CLIENTS)
    outcomes: dict[int, str] = {}
    with running_server(llm) as base:

        def client(i: int) -> None:
            body = {"prompt": [5 + i % 7, 6], "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}
            abandon = i % 2 == 0
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                chunks = 0
                for line in response.iter_lines():
                    chunks += line.startswith("data: ")
                    if abandon and chunks == 3:
                        outcomes[i] = "abandoned"
                        return  # closing the stream = the client disconnects mid-generation
                outcomes[i] = "done" if chunks > 60 else f"short:{chunks}"

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        wait_until(lambda: llm.stats().num_running == 0 and llm.stats().num_waiting == 0, timeout=30)
        health = httpx.get(base + "/health").json()
    llm.close()
    assert sorted(outcomes.values()).count("done") == CLIENTS // 2
    assert sorted(outcomes.values()).count("abandoned") == CLIENTS // 2
    counters = llm.stats().counters
    assert counters.cancelled == CLIENTS // 2 and counters.completed == CLIENTS // 2
    assert health["kv_cache"]["kv_blocks_used"] == 0 and llm.stats().kv.num_used_blocks == 0
