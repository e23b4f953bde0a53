"""A bounded burst over loopback with half the clients abandoning mid-stream: afterwards nothing
runs, nothing waits, and every KV block is back in the pool. An abandoned request cannot finish
before its client has gone: it takes no step past its HOLD_AT-th until its abort arrives."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
from server_harness import running_server
from waiting import StepGate, wait_until

from ifb import LLM
from ifb.runtime.scheduler import ScheduledBatch

CLIENTS = 24
ABANDON_AFTER = 3  # chunks an abandoning client reads
HOLD_AT = 5  # steps (tokens) after which an abandoned request waits for its abort


def test_burst_with_abandoning_clients_leaks_nothing(tiny_llama_engine: Path) -> None:
    llm = LLM(tiny_llama_engine, max_batch_size=8, max_queued_requests=CLIENTS)
    outcomes: dict[int, str] = {}
    with running_server(llm) as base, StepGate(llm.executor) as gate:

        def abandoned_ones_wait(batch: ScheduledBatch) -> bool:  # abandoning clients send 3-token prompts
            for item in batch.requests:
                request = gate.submitted.get(item.request_id)
                if request is None or gate.steps[item.request_id] < HOLD_AT or item.request_id in gate.aborted:
                    continue
                if request.num_prompt_tokens == 3:
                    return False
            return True

        gate.allow = abandoned_ones_wait

        def client(i: int) -> None:
            abandon = i % 2 == 0
            prompt = [5 + i % 7, 6, 9] if abandon else [5 + i % 7, 6]
            body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                chunks = 0
                for line in response.iter_lines():
                    chunks += line.startswith("data: ")
                    if abandon and chunks == ABANDON_AFTER:
                        outcomes[i] = "abandoned"
                        return  # closing the stream = the client disconnects mid-generation
                outcomes[i] = "done" if chunks > 60 else f"short:{chunks}"

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        wait_until(lambda: llm.stats().num_running == 0 and llm.stats().num_waiting == 0, 30, "an idle engine")
        health = httpx.get(base + "/health").json()
    llm.close()
    assert sorted(outcomes.values()).count("done") == CLIENTS // 2
    assert sorted(outcomes.values()).count("abandoned") == CLIENTS // 2
    counters = llm.stats().counters
    assert counters.cancelled == CLIENTS // 2 and counters.completed == CLIENTS // 2
    assert health["kv_cache"]["kv_blocks_used"] == 0 and llm.stats().kv.num_used_blocks == 0
