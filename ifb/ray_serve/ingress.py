"""The ingress deployment: the `ifb run` server app (create_app) over a ReplicaSetLLM, with
/health and /metrics answered from every replica's latest report instead of one engine's.

/health: 200 while any replica can serve, 503 when none can; per replica its own /health body
(as `ifb run` gives it) and its report's age, plus the scheduling and KV blocks summed.
/metrics: each replica's `ifb:` series with a `replica` label, and `ifb:num_replicas_ready`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from ifb.ray_serve.proxy import ReplicaSetLLM
from ifb.runtime.runtime_config import RuntimeSettings
from ifb.runtime.server import create_app

logger = logging.getLogger(__name__)

_MAX_FIELDS = ("queue_latency_max_us",)
_AVERAGED_FIELDS = {"queue_latency_avg_us": "completed"}  # weighted by this count


class IfbIngress:
    """Wrapped by `serve.ingress()` and `serve.deployment` in deploy.py."""

    def __init__(
        self, replicas: Any, engine: str, settings: RuntimeSettings, num_replicas: int, app_options: dict[str, Any]
    ) -> None:
        """Serve constructs this inside its own async __init__: the event loop is running."""
        self.llm = ReplicaSetLLM(engine, settings, replicas, num_replicas)
        self.app_options = app_options
        self._warm = asyncio.ensure_future(self._start_router(replicas))

    async def _start_router(self, replicas: Any) -> None:
        """Send one call so Serve builds this process's router, which /health reads."""
        try:
            await replicas.options(method_name="ping").remote()
        except Exception:
            logger.exception("the first call to the replicas failed")

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.llm, **self.app_options)
        _replace_get(app, "/health", self.health)
        _replace_get(app, "/metrics", self.metrics)
        return app

    async def health(self) -> JSONResponse:
        body = health_body(self.llm.model_name, self.llm.replica_stats(), time.time())
        return JSONResponse(body, status_code=200 if body["num_ready"] else 503)

    async def metrics(self) -> Response:
        registry = CollectorRegistry()
        registry.register(_ReplicaCollector(self.llm.replica_stats()))
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _replace_get(app: FastAPI, path: str, endpoint: Callable[..., Any]) -> None:
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != path]
    app.get(path)(endpoint)


def health_body(model: str, stats: dict[str, dict[str, Any]], now: float) -> dict[str, Any]:
    replicas: dict[str, dict[str, Any]] = {}
    for name, report in sorted(stats.items()):
        if "health" not in report:  # running, but no report yet
            replicas[name] = {"status": "starting"}
            continue
        replicas[name] = {
            **report["health"],
            "pid": report.get("pid"),
            "router_in_flight": report.get("router_in_flight", 0),
            "report_age_s": round(now - report.get("reported_at", now), 3),
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


class _ReplicaCollector(Collector):
    """Every replica's metrics text, re-labelled with `replica`, merged family by family."""

    def __init__(self, stats: dict[str, dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for name, report in sorted(self.stats.items()):
            for family in text_string_to_metric_families(report.get("metrics", "")):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    labels = {**sample.labels, "replica": name}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
        ready = Metric("ifb:num_replicas_ready", "Replicas whose engine can serve.", "gauge")
        ready.add_sample("ifb:num_replicas_ready", {}, sum(1 for s in self.stats.values() if s.get("ok")))
        yield ready
        yield from families.values()
