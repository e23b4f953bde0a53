"""ReplicaReport: what each replica publishes every stats period, and ReplicaView: one running
replica as the ingress's router sees it. Serve carries routing stats as a plain dict; these are
the only place its keys are spelled."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    replica: str
    pid: int
    reported_at: float  # time.time() on the replica
    ok: bool  # its step loop can serve
    num_running: int
    num_waiting: int
    capacity: int  # max_batch_size + max_queued_requests: its engine's admission limit
    health: dict[str, Any]  # its own /health body, as `ifb run` gives it
    metrics: str  # its Prometheus text

    @classmethod
    def from_stats(cls, stats: dict[str, Any] | None) -> ReplicaReport | None:
        """None until the replica's first report reached the router."""
        if not stats:
            return None
        return cls(**{f.name: stats[f.name] for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class ReplicaView:
    report: ReplicaReport | None
    router_in_flight: int  # requests this router sent it and has not seen finish
