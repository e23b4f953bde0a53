"""SchedulerStats: the scheduling counters the executor thread keeps, and their frozen copy."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class SchedulerCounters:
    """A published copy of the counters (Edge-LLM's /health scheduling block and more)."""

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

    @property
    def queue_latency_avg_s(self) -> float:
        return self.queue_latency_total_s / self.num_admitted if self.num_admitted else 0.0


@dataclass(slots=True)
class SchedulerStats:
    """The live counters; only the executor thread writes them. Same fields as SchedulerCounters
    (a unit test holds the two lists equal)."""

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

    def freeze(self) -> SchedulerCounters:
        return SchedulerCounters(**{f.name: getattr(self, f.name) for f in fields(self)})
