"""The replica set's /health body and /metrics text, from every replica's latest report.

/health: ok while any replica can serve; per replica its own /health body (as `ifb run` gives
it) and its report's age, plus the scheduling and KV blocks summed.
/metrics: each replica's `ifb:` series with a `replica` label, and `ifb:num_replicas_ready`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ifb.ray_serve.report import ReplicaView

_MAX_FIELDS = ("queue_latency_max_us",)
_AVERAGED_FIELDS = {"queue_latency_avg_us": "completed"}  # weighted by this count


def health_body(model: str, views: dict[str, ReplicaView], now: float) -> dict[str, Any]:
    replicas: dict[str, dict[str, Any]] = {}
    for name, view in sorted(views.items()):
        report = view.report
        if report is None:  # running, but no report yet
            replicas[name] = {"status": "starting"}
            continue
        replicas[name] = {
            **report.health,
            "pid": report.pid,
            "router_in_flight": view.router_in_flight,
            "report_age_s": round(now - report.reported_at, 3),
        }
    reported = [r for r in replicas.values() if "scheduling" in r]
    num_ready = sum(1 for r in reported if r["status"] == "ok")
    return {
        "status": "ok" if num_ready else "unhealthy",
        "model": model,
        "num_replicas": len(replicas),
        "num_ready": num_ready,
        "scheduling": summed_block([r["scheduling"] for r in reported]),
        "kv_cache": summed_block([r["kv_cache"] for r in reported]),
        "replicas": replicas,
    }


def summed_block(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts summed; maxima as the max; averages weighted by their count."""
    total: dict[str, Any] = {}
    for key in blocks[0] if blocks else ():
        values = [b[key] for b in blocks]
        if key in _MAX_FIELDS:
            total[key] = max(values)
        elif key in _AVERAGED_FIELDS:
            weights = [b[_AVERAGED_FIELDS[key]] for b in blocks]
            total[key] = int(sum(v * w for v, w in zip(values, weights, strict=True)) / max(1, sum(weights)))
        else:
            total[key] = sum(values)
    return total


def metrics_text(views: dict[str, ReplicaView]) -> bytes:
    registry = CollectorRegistry()
    registry.register(_ReplicaCollector(views))
    return generate_latest(registry)


class _ReplicaCollector(Collector):
    """Every replica's metrics text, re-labelled with `replica`, merged family by family."""

    def __init__(self, views: dict[str, ReplicaView]) -> None:
        self.views = views

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for name, view in sorted(self.views.items()):
            text = view.report.metrics if view.report is not None else ""
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    labels = {**sample.labels, "replica": name}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
        ready = Metric("ifb:num_replicas_ready", "Replicas whose engine can serve.", "gauge")
        num_ready = sum(1 for v in self.views.values() if v.report is not None and v.report.ok)
        ready.add_sample("ifb:num_replicas_ready", {}, num_ready)
        yield ready
        yield from families.values()
