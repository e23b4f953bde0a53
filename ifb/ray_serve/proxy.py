"""ReplicaSetLLM: the EngineClient (runtime/engine_client.py) whose requests run on Serve replicas.

create_app serves it as it serves the in-process LLM: tokenizing, chat templates and
detokenizing run here with the engine's own tokenizer (runtime Frontend); `open_streams` sends
the prepared token ids to one replica chosen by the PrefixAffinityRouter and hands back one
async iterator of deltas per job, exactly as the runtime LLM does; health, stats and metrics
come from the replicas' latest reports (aggregate.py). A replica that is full answers with a refusal
and the call is retried on the others; only when every replica refused is QueueFullError (429)
raised. A replica that dies mid-request ends its streams with finish_reason `error`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from ifb.ray_serve import aggregate
from ifb.ray_serve.affinity import router_for
from ifb.ray_serve.replica import Delta, Opened, Refused
from ifb.ray_serve.report import ReplicaView
from ifb.runtime.drain_rate import MIN_RETRY_S
from ifb.runtime.engine_client import HealthReport, Job
from ifb.runtime.engine_snapshot import EngineSnapshot, ExecutorHealth
from ifb.runtime.errors import AdmissionError, EngineUnavailableError, QueueFullError
from ifb.runtime.frontend_client import FrontendClient
from ifb.runtime.outputs import RequestOutput, until_final
from ifb.runtime.request import FinishReason
from ifb.runtime.runtime_config import RuntimeSettings

logger = logging.getLogger(__name__)


class ReplicaSetLLM(FrontendClient):
    def __init__(self, engine: str | Path, settings: RuntimeSettings, handle: Any, num_replicas: int) -> None:
        """`handle`: the replica deployment's DeploymentHandle."""
        super().__init__(engine, settings, verify=False)  # the replicas verify what they load
        self.deployment_name = handle.deployment_name
        self.num_replicas = num_replicas
        self._generate = handle.options(method_name="generate", stream=True)
        self._calls: dict[str, _Call] = {}  # request id -> the call carrying it, until it finished

    async def open_streams(
        self, jobs: Sequence[Job], block: bool = False, count_refusal: bool = True
    ) -> list[AsyncIterator[RequestOutput]]:
        """Seat all jobs on one replica (all or none); a full replica's refusal is retried on
        another, so a 429 means every replica refused. `block` is not supported (the server
        never blocks)."""
        avoid: list[str] = []
        failure: str | None = None
        for _ in range(self.num_replicas + 1):
            response = self._generate.remote(list(jobs), avoid=tuple(avoid))
            try:
                first = await response.__anext__()
            except Exception as error:
                from ray.exceptions import RayError

                if not isinstance(error, RayError):
                    raise
                failure = _short(error)  # Serve drops a dead replica from the router: try again
                logger.warning("a replica failed before seating a request: %s", failure)
                continue
            except BaseException:
                response.cancel()
                raise
            if isinstance(first, Opened):
                return _Call(response, len(jobs), first.replica, self._calls).streams()
            assert isinstance(first, Refused)
            if first.kind == "EngineUnavailableError":
                raise EngineUnavailableError(first.message)
            if first.kind != "QueueFullError":  # an AdmissionError (or a kind of it): a 400 naming its field
                raise AdmissionError(first.message, field=first.field)
            avoid.append(first.replica)
        if failure is not None and not avoid:
            raise EngineUnavailableError(f"no replica could take the request: {failure}")
        raise QueueFullError(f"every replica is full ({len(avoid)} refused); retry later")

    def abort(self, request_id: str) -> None:
        """Cancels the Serve call carrying the request: with n > 1 choices, its siblings too
        (one call seats all of a response's choices on one replica)."""
        call = self._calls.get(request_id)
        if call is not None:
            call.cancel()

    # -- introspection: the replicas' latest reports ------------------------------------------
    def replica_views(self) -> dict[str, ReplicaView]:
        router = router_for(self.deployment_name)
        return {} if router is None else router.replica_views()

    def stats(self) -> EngineSnapshot:
        """Running and waiting summed over replicas."""
        reports = [v.report for v in self.replica_views().values() if v.report is not None]
        return EngineSnapshot(
            num_running=sum(r.num_running for r in reports), num_waiting=sum(r.num_waiting for r in reports)
        )

    def health(self) -> ExecutorHealth:
        """Healthy while any replica can serve."""
        if any(v.report is not None and v.report.ok for v in self.replica_views().values()):
            return ExecutorHealth(alive=True, stuck=False, error=None)
        return ExecutorHealth(alive=False, stuck=False, error="no replica can serve")

    def health_report(self) -> HealthReport:
        body = aggregate.health_body(self.model_info.name, self.replica_views(), time.time())
        return HealthReport(body["num_ready"] > 0, body)

    def metrics_text(self) -> bytes:
        return aggregate.metrics_text(self.replica_views())

    def retry_after_s(self) -> int:
        # Finishes happen in the replicas and are not reported here; the ingress only retries a
        # refusal on the other replicas, so a 429 means all are full: the shortest wait.
        return MIN_RETRY_S


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class _Call:
    """One Serve streaming call carrying several jobs: a pump task splits its Deltas into one
    queue per job. Closing a job's iterator before it finished cancels the whole call (the
    replica aborts its requests); the server closes every iterator of a response together."""

    def __init__(self, response: Any, num_jobs: int, replica: str, registry: dict[str, _Call]) -> None:
        self.response = response
        self.replica = replica
        self.registry = registry  # request id -> call, for abort(); each id leaves with its final delta
        self.queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue() for _ in range(num_jobs)]
        self.request_ids = [""] * num_jobs
        self.done = [False] * num_jobs  # a final delta was queued
        self.pump = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        message = f"replica {self.replica} ended the stream early"
        try:
            async for delta in self.response:
                assert isinstance(delta, Delta)
                request_id = self.request_ids[delta.index] = delta.output.request_id
                self.done[delta.index] = delta.output.finished
                if delta.output.finished:
                    self.registry.pop(request_id, None)
                else:
                    self.registry[request_id] = self
                self.queues[delta.index].put_nowait(delta.output)
        except Exception as error:
            message = f"replica {self.replica} failed mid-request ({_short(error)}); retry the request"
            logger.warning("%s", message)
        for i, queue in enumerate(self.queues):
            self.registry.pop(self.request_ids[i], None)
            if not self.done[i]:
                self.done[i] = True
                queue.put_nowait(RequestOutput(self.request_ids[i], (), "", True, FinishReason.ERROR, error=message))

    def streams(self) -> list[AsyncIterator[RequestOutput]]:
        return [until_final(queue, self.cancel) for queue in self.queues]

    def cancel(self) -> None:
        for request_id in self.request_ids:
            self.registry.pop(request_id, None)
        if not self.pump.done():
            self.response.cancel()
            self.pump.cancel()
