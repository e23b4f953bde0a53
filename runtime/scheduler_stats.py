"""SchedulerStats: the scheduling counters behind /health, /metrics and LLM.stats()."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class SchedulerStats:
    submitted: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: int = 0
    admitted_mid_flight: int = 0
    preempted: int = 0
    stalls_no_capacity: int = 0
    stalls_token_budget: int = 0
    stalls_batch_full: int = 0
    queue_latency_total_s: float = 0.0
    queue_latency_max_s: float = 0.0
    num_admitted: int = 0
    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def record_queue_latency(self, seconds: float) -> None:
        self.num_admitted += 1
        self.queue_latency_total_s += seconds
        self.queue_latency_max_s = max(self.queue_latency_max_s, seconds)

    def snapshot(self) -> dict[str, Any]:
        data = asdict(self)
        average = self.queue_latency_total_s / self.num_admitted if self.num_admitted else 0.0
        data["queue_latency_avg_us"] = int(average * 1e6)
        data["queue_latency_max_us"] = int(self.queue_latency_max_s * 1e6)
        for key in ("queue_latency_total_s", "queue_latency_max_s"):
            del data[key]
        return data
