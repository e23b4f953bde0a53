"""SchedulerStats: the scheduling counters the executor thread keeps, and their frozen copy."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class SchedulerCounters:
    """A published copy of the counters (Edge-LLM's /health scheduling block and more); its
    fields are the one list of counters: SchedulerStats is made from them."""

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
    # Speculation, vLLM's spec_decode counters: verified drafts, their tokens, the tokens of them
    # that held, and what those steps emitted (kept drafts and the token after them).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_emitted_tokens: int = 0
    # The draft and accepted tokens again, each decayed by SPEC_RECENT_DECAY per verified draft:
    # their ratio is the acceptance rate of about the last 100 drafts, what /health calls current
    # (the lifetime ratio of a long-running server hardly moves when its traffic changes).
    spec_recent_draft_tokens: float = 0.0
    spec_recent_accepted_tokens: float = 0.0

    @property
    def queue_latency_avg_s(self) -> float:
        return self.queue_latency_total_s / self.num_admitted if self.num_admitted else 0.0


SPEC_RECENT_DECAY = 0.99


def _record_draft(stats: Any, num_draft: int, num_accepted: int, num_emitted: int) -> None:
    """A verified draft of `num_draft` tokens, `num_accepted` of which held; its step emitted
    `num_emitted` tokens for the request."""
    stats.spec_num_drafts += 1
    stats.spec_num_draft_tokens += num_draft
    stats.spec_num_accepted_tokens += num_accepted
    stats.spec_num_emitted_tokens += num_emitted
    stats.spec_recent_draft_tokens = stats.spec_recent_draft_tokens * SPEC_RECENT_DECAY + num_draft
    stats.spec_recent_accepted_tokens = stats.spec_recent_accepted_tokens * SPEC_RECENT_DECAY + num_accepted


def _record_queue_latency(stats: Any, seconds: float) -> None:
    stats.num_admitted += 1
    stats.queue_latency_total_s += seconds
    stats.queue_latency_max_s = max(stats.queue_latency_max_s, seconds)


def _freeze(stats: Any) -> SchedulerCounters:
    return SchedulerCounters(**{f.name: getattr(stats, f.name) for f in fields(SchedulerCounters)})


# The live counters, written only by the executor thread: SchedulerCounters' fields made mutable
# (a mutable dataclass cannot subclass a frozen one), so each counter is declared once.
# slots: a misspelt counter raises instead of silently adding an attribute.
SchedulerStats = make_dataclass(
    "SchedulerStats",
    [(f.name, f.type, field(default=f.default)) for f in fields(SchedulerCounters)],
    namespace={
        "record_queue_latency": _record_queue_latency,
        "record_draft": _record_draft,
        "freeze": _freeze,
        "__module__": __name__,
    },
    slots=True,
)
