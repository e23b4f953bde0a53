"""Run a workload in-process through the Python API (one LLM per mode) or against a URL."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ifb.cli.bench_metrics import RequestTiming
from ifb.cli.bench_workloads import BenchRequest
from ifb.runtime.executor import StepRecord
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.trace import TraceRecorder

MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "sequential": {"max_batch_size": 1},
    "static_batch": {"policy": "static_batch"},
    "guaranteed_no_evict": {"policy": "guaranteed_no_evict"},
    "max_utilization": {"policy": "max_utilization"},
    "ngram": {"speculative": "ngram"},  # guaranteed_no_evict with prompt-lookup speculation
    "suffix": {"speculative": "suffix"},
    "ttft_off": {"ttft_target_ms": 0},  # guaranteed_no_evict whose steps ignore first-token deadlines
}

Progress = Callable[[int], None]


@dataclass
class ModeRun:
    name: str
    timings: list[RequestTiming]
    wall_s: float
    steps: list[StepRecord] = field(default_factory=list)
    finish_times: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    max_batch_size: int = 0


def run_in_process(
    engine: Path,
    mode: str,
    workload: Sequence[BenchRequest],
    options: dict[str, Any],
    time_limit_s: float,
    progress: Progress,
    trace: Path | None = None,
) -> ModeRun:
    from ifb import LLM, SamplingParams

    settings = {**options, **MODE_OPTIONS[mode]}  # sequential's max_batch_size=1 wins over --max-batch-size
    with LLM(engine, max_queued_requests=len(workload) + 1, **settings) as llm:
        recorder = TraceRecorder.attach(llm.executor) if trace is not None else None
        steps: list[StepRecord] = []
        llm.executor.step_listeners.append(steps.append)
        finish_times: dict[str, float] = {}
        llm.executor.finish_listeners.append(lambda r: finish_times.__setitem__(r.request_id, time.perf_counter()))
        prompts = [llm.tokenize(r.prompt) for r in workload]
        timings = [RequestTiming(arrival=0.0) for _ in workload]
        remaining = threading.Semaphore(0)
        ids = []
        start = time.perf_counter()
        for index, (request, prompt) in enumerate(zip(workload, prompts, strict=True)):
            time.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
            timing = timings[index]
            timing.arrival = time.perf_counter()

            def sink(output: RequestOutput, timing: RequestTiming = timing) -> None:
                now = time.perf_counter()
                if output.new_token_ids:
                    timing.token_times.append(now)
                if output.finished:
                    timing.finished, timing.num_tokens = now, output.num_output_tokens
                    timing.ok = output.finish_reason is not None and output.finish_reason.value in ("stop", "length")
                    if output.queue_s is not None:
                        timing.admitted = timing.arrival + output.queue_s
                    remaining.release()
                    progress(1)

            params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
            ids.append(llm.submit(prompt, params, sink))
        deadline = start + time_limit_s
        for _ in workload:
            if not remaining.acquire(timeout=max(0.0, deadline - time.perf_counter())):
                for request_id in ids:  # bounded in time: abort what is left
                    llm.abort(request_id)
                break
        wall = time.perf_counter() - start
        llm.executor.step_listeners.remove(steps.append)
        run = ModeRun(
            mode, timings, wall, steps, finish_times, dataclasses.asdict(llm.stats()), llm.config.max_batch_size
        )
        if recorder is not None and trace is not None:
            recorder.write(trace.with_name(f"{trace.stem}-{mode}{trace.suffix}"))
    return run


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    with contextlib.suppress(ValueError):  # not an IP address
        if host == "localhost" or ipaddress.ip_address(host).is_loopback:
            return
    raise ValueError(f"--url must point at this machine (loopback), got host {host!r}")


async def _one_http(
    client: Any, url: str, model: str, request: BenchRequest, start: float, timing: RequestTiming, progress: Progress
) -> None:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    timing.arrival = time.perf_counter()
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.ok = False
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    timing.token_times.append(time.perf_counter())
                if chunk.get("usage"):
                    timing.num_tokens = int(chunk["usage"]["completion_tokens"])
        timing.finished = time.perf_counter()
        timing.num_tokens = timing.num_tokens or len(timing.token_times)
    except Exception:
        timing.ok = False
    finally:
        progress(1)


def run_against_url(url: str, workload: Sequence[BenchRequest], time_limit_s: float, progress: Progress) -> ModeRun:
    import httpx

    check_loopback(url)
    url = url.rstrip("/")

    async def main() -> tuple[list[RequestTiming], float]:
        async with httpx.AsyncClient(timeout=time_limit_s) as client:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
            timings = [RequestTiming(arrival=0.0) for _ in workload]
            start = time.perf_counter()
            tasks = [
                _one_http(client, url, model, r, start, t, progress) for r, t in zip(workload, timings, strict=True)
            ]
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), timeout=time_limit_s)
            except TimeoutError:
                pass
            return timings, time.perf_counter() - start

    timings, wall = asyncio.run(main())
    return ModeRun(url, timings, wall)
