"""The replica deployment: one runtime LLM (executor, scheduler, limits as `ifb run` has them),
its requests streamed back to the ingress, and its state published as Serve routing stats.

Messages to the ingress are plain frozen dataclasses. A refusal is a message, not a raised
exception: Ray would wrap an exception in a RayTaskError whose text carries the remote
traceback, and an AdmissionError's `field` would not survive pickling.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ifb.ray_serve.report import ReplicaReport
from ifb.runtime.engine_client import Job
from ifb.runtime.errors import AdmissionError, IfbError
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.runtime_config import RuntimeSettings
from ifb.runtime.server.streams import close_all, first_delta, merge
from ifb.runtime.step.engine import set_compute_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Opened:
    """The replica seated every job of the call; deltas follow."""

    replica: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The replica's engine refused the call (nothing was seated). `kind` names the IfbError."""

    replica: str
    kind: str
    message: str
    field: str | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    index: int  # which job of the call
    output: RequestOutput


def replica_settings(settings: RuntimeSettings, replica: str) -> RuntimeSettings:
    """A replica's own settings: its trace file is `--trace`'s name with -REPLICA added."""
    if settings.trace is None:
        return settings
    path = Path(settings.trace)
    return replace(settings, trace=str(path.with_name(f"{path.stem}-{replica}{path.suffix}")))


class IfbReplica:
    """Wrapped by `serve.deployment` in deploy.py; Serve calls `record_routing_stats` every
    request_routing_stats_period_s and hands the result to the ingress's router."""

    def __init__(self, engine: str, settings: RuntimeSettings, threads: int | None = None) -> None:
        from ray import serve

        from ifb.runtime.llm import LLM

        set_compute_threads(threads)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.llm = LLM(engine, replica_settings(settings, self.replica))
        self.llm.start_guided_workers()
        logger.info("replica %s serving %s (pid %d)", self.replica, self.llm.model_name, os.getpid())

    async def generate(self, jobs: Sequence[Job], avoid: Sequence[str] = ()) -> AsyncIterator[Opened | Refused | Delta]:
        """Seat all jobs (or none: one Refused), then every delta of every job as it comes.
        Cancelling the call (client gone) closes the streams, which aborts unfinished requests.
        `avoid` is for the router (replicas that refused this call already)."""
        try:
            streams = await self.llm.open_streams(list(jobs))
        except IfbError as error:
            field = error.field if isinstance(error, AdmissionError) else None
            yield Refused(self.replica, type(error).__name__, str(error), field)
            return
        yield Opened(self.replica)
        tasks: list[asyncio.Task[None]] = []
        try:
            first = list(await asyncio.gather(*(first_delta(s) for s in streams)))
            merged, tasks = merge(streams, first)
            async for index, output in merged:
                yield Delta(index, output)
        finally:
            await close_all(streams, tasks)

    def ping(self) -> str:
        return self.replica

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes it replace the replica.
        Only a dead step loop counts: a stuck step may still finish."""
        health = self.llm.health()
        if not health.alive or health.error is not None:
            raise RuntimeError(f"replica {self.replica}: the step loop died: {health.error}")

    def record_routing_stats(self) -> dict[str, Any]:
        """Load for the router; the /health body and the metrics text for the ingress."""
        llm = self.llm
        snapshot, health = llm.stats(), llm.health_report()
        report = ReplicaReport(
            replica=self.replica,
            pid=os.getpid(),
            reported_at=time.time(),
            ok=health.ok,
            num_running=snapshot.num_running,
            num_waiting=snapshot.num_waiting,
            capacity=llm.capacity,
            health=health.body,
            metrics=llm.metrics_text().decode(),
        )
        return asdict(report)

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()
