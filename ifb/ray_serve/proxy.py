"""ReplicaSetLLM: an LLM-shaped object for create_app whose requests run on Serve replicas.

The server code is reused as is (duck typing): tokenizing, chat templates and detokenizing run
here with the engine's own tokenizer (runtime Frontend); `open_streams` sends the prepared token
ids to one replica chosen by the PrefixAffinityRouter and hands back one async iterator of
deltas per job, exactly as the runtime LLM does. A replica that is full answers with a refusal
and the call is retried on the others; only when every replica refused is QueueFullError (429)
raised. A replica that dies mid-request ends its streams with finish_reason `error`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ifb.ray_serve.affinity import router_for
from ifb.ray_serve.replica import Delta, Job, Opened, Refused
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.engine_snapshot import EngineSnapshot, ExecutorHealth
from ifb.runtime.errors import AdmissionError, EngineUnavailableError, IfbError, QueueFullError
from ifb.runtime.frontend import Frontend, Prompt
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.runtime_config import RuntimeConfig, RuntimeSettings, resolve_runtime_config

logger = logging.getLogger(__name__)

T = TypeVar("T")
FRONTEND_WORKERS = 2
_REFUSALS: dict[str, type[IfbError]] = {
    "QueueFullError": QueueFullError,
    "EngineUnavailableError": EngineUnavailableError,
}


@dataclass(slots=True)
class _ExecutorShape:
    """What create_app and Metrics touch on `llm.executor`. Nothing runs here, so the listeners
    never fire: each replica keeps its own metrics, and Retry-After falls back to its minimum."""

    queue_timeout_s: float | None = None
    finish_listeners: list[Callable[[Any], None]] = field(default_factory=list)
    step_listeners: list[Callable[[Any], None]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Gate:
    capacity: int


@dataclass(frozen=True, slots=True)
class _ClientShape:
    gate: _Gate


class ReplicaSetLLM:
    def __init__(self, engine: str | Path, settings: RuntimeSettings, handle: Any, num_replicas: int) -> None:
        """`handle`: the replica deployment's DeploymentHandle."""
        from transformers import AutoTokenizer

        self.settings = settings
        self.engine_config = EngineConfig.load(engine, verify=False)  # the replicas verify what they load
        self.config: RuntimeConfig = resolve_runtime_config(self.engine_config, settings)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.engine_config.tokenizer_path))
        self.frontend = Frontend(self.engine_config, self.config, self.tokenizer, settings.chat_template)
        self.executor = _ExecutorShape()
        self.client = _ClientShape(_Gate(self.config.max_batch_size + self.config.max_queued_requests))
        self.deployment_name = handle.deployment_name
        self.num_replicas = num_replicas
        self._generate = handle.options(method_name="generate", stream=True)
        self._workers = ThreadPoolExecutor(max_workers=FRONTEND_WORKERS, thread_name_prefix="ifb-frontend")

    @property
    def model_name(self) -> str:
        return self.engine_config.model_name

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.frontend.tokenize(prompt)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self.frontend.apply_chat_template(messages, tools)

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._workers, function, *args)

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
                if not _is_replica_failure(error):
                    raise
                failure = _short(error)  # Serve drops a dead replica from the router: try again
                logger.warning("a replica failed before seating a request: %s", failure)
                continue
            except BaseException:
                response.cancel()
                raise
            if isinstance(first, Opened):
                return _Call(response, len(jobs), first.replica).streams()
            assert isinstance(first, Refused)
            if first.kind != "QueueFullError":
                raise _refusal_error(first)
            avoid.append(first.replica)
        if failure is not None and not avoid:
            raise EngineUnavailableError(f"no replica could take the request: {failure}")
        raise QueueFullError(f"every replica is full ({len(avoid)} refused); retry later")

    # -- introspection: the replicas' latest routing stats ----------------------------------
    def replica_stats(self) -> dict[str, dict[str, Any]]:
        router = router_for(self.deployment_name)
        return {} if router is None else router.replica_stats()

    def stats(self) -> EngineSnapshot:
        """Running and waiting summed over replicas (create_app's 429 handler reads these)."""
        stats = self.replica_stats().values()
        return EngineSnapshot(
            num_running=sum(int(s.get("num_running", 0)) for s in stats),
            num_waiting=sum(int(s.get("num_waiting", 0)) for s in stats),
        )

    def health(self) -> ExecutorHealth:
        """Healthy while any replica can serve."""
        stats = self.replica_stats().values()
        if any(s.get("ok") for s in stats):
            return ExecutorHealth(alive=True, stuck=False, error=None)
        return ExecutorHealth(alive=False, stuck=False, error="no replica can serve")

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)


def _is_replica_failure(error: Exception) -> bool:
    from ray.exceptions import RayError

    return isinstance(error, RayError)


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _refusal_error(refused: Refused) -> IfbError:
    if refused.kind in _REFUSALS:
        return _REFUSALS[refused.kind](refused.message)
    return AdmissionError(refused.message, field=refused.field)


class _Call:
    """One Serve streaming call carrying several jobs: a pump task splits its Deltas into one
    queue per job. Closing a job's iterator before it finished cancels the whole call (the
    replica aborts its requests); the server closes every iterator of a response together."""

    def __init__(self, response: Any, num_jobs: int, replica: str) -> None:
        self.response = response
        self.replica = replica
        self.queues: list[asyncio.Queue[RequestOutput]] = [asyncio.Queue() for _ in range(num_jobs)]
        self.request_ids = [""] * num_jobs
        self.done = [False] * num_jobs  # a final delta was queued
        self.pump = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        message = f"replica {self.replica} ended the stream early"
        try:
            async for delta in self.response:
                assert isinstance(delta, Delta)
                self.request_ids[delta.index] = delta.output.request_id
                self.done[delta.index] = delta.output.finished
                self.queues[delta.index].put_nowait(delta.output)
        except Exception as error:
            message = f"replica {self.replica} failed mid-request ({_short(error)}); retry the request"
            logger.warning("%s", message)
        for i, queue in enumerate(self.queues):
            if not self.done[i]:
                self.done[i] = True
                queue.put_nowait(RequestOutput(self.request_ids[i], (), "", True, FinishReason.ERROR, error=message))

    def streams(self) -> list[AsyncIterator[RequestOutput]]:
        return [self._stream(i) for i in range(len(self.queues))]

    async def _stream(self, index: int) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await self.queues[index].get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.cancel()

    def cancel(self) -> None:
        if not self.pump.done():
            self.response.cancel()
            self.pump.cancel()
