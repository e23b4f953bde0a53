"""TraceRecorder: the executor's steps and each request's lifetime as Chrome trace events
(open the file in Perfetto or chrome://tracing). Bounded: the oldest events are dropped."""

from __future__ import annotations

import json
import threading
from collections import deque
from pathlib import Path
from typing import Any

from ifb.runtime.executor import Executor, StepRecord
from ifb.runtime.request import Request

_STEP_TRACK = 0
_REQUEST_TRACK = 1


class TraceRecorder:
    def __init__(self, max_events: int = 200_000) -> None:
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    @classmethod
    def attach(cls, executor: Executor, max_events: int = 200_000) -> TraceRecorder:
        recorder = cls(max_events)
        executor.step_listeners.append(recorder.on_step)
        executor.finish_listeners.append(recorder.on_finish)
        return recorder

    def on_step(self, step: StepRecord) -> None:
        event = {
            "name": "step",
            "ph": "X",
            "pid": _STEP_TRACK,
            "tid": 0,
            "ts": step.start * 1e6,
            "dur": (step.end - step.start) * 1e6,
            "args": {
                "tokens": step.num_tokens,
                "requests": step.num_requests,
                "prefills": len(step.prefill_ids),
                "kv_blocks_used": step.num_used_blocks,
                "measured_ms": round(1000 * (step.end - step.start), 3),
                "predicted_ms": None if step.predicted_ms is None else round(step.predicted_ms, 3),
                # speculation: per request that verified a draft, [proposed, accepted]
                "drafts": {d.request_id: [d.num_proposed, d.num_accepted] for d in step.drafts},
            },
        }
        with self._lock:
            self.events.append(event)
            if step.predicted_ms is not None:  # a counter track: both curves, one graph in Perfetto
                times = {"measured": 1000 * (step.end - step.start), "predicted": step.predicted_ms}
                self.events.append(
                    {"name": "step_ms", "ph": "C", "pid": _STEP_TRACK, "ts": step.start * 1e6, "args": times}
                )

    def on_finish(self, request: Request) -> None:
        t = request.times
        start = t.arrival
        end = t.finished if t.finished is not None else start
        event = {
            "name": request.request_id,
            "ph": "X",
            "pid": _REQUEST_TRACK,
            "tid": hash(request.request_id) % 64,
            "ts": start * 1e6,
            "dur": max(0.0, end - start) * 1e6,
            "args": {
                "finish_reason": request.finish_reason.value if request.finish_reason else None,
                "prompt_tokens": request.num_prompt_tokens,
                "output_tokens": request.num_output_tokens,
                "queue_s": None if t.admitted is None else t.admitted - t.arrival,
                "ttft_s": None if t.first_token is None else t.first_token - t.arrival,
                "preemptions": request.num_preemptions,
            },
        }
        with self._lock:
            self.events.append(event)

    def write(self, path: Path) -> None:
        with self._lock:
            events = list(self.events)
        meta = [
            {"name": "process_name", "ph": "M", "pid": _STEP_TRACK, "args": {"name": "executor steps"}},
            {"name": "process_name", "ph": "M", "pid": _REQUEST_TRACK, "args": {"name": "requests"}},
        ]
        path.write_text(json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ms"}))
