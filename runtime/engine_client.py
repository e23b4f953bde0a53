"""EngineClient: the one interface the HTTP server (runtime/server/) uses of an engine.

The vLLM shape: prepare and seat requests, stream their deltas, abort them, and read health,
stats, metrics, capacity and model info. The in-process `LLM` (runtime/llm.py) and the Ray
replica set (ifb/ray_serve/proxy.py) both implement it, so one app serves either; the server
imports nothing else of the engine (tests/unit/test_layering.py). docs/design.md §2 has the
request's path through it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ifb.runtime.engine_snapshot import EngineSnapshot, ExecutorHealth
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.sampling_params import SamplingParams

T = TypeVar("T")
Job = tuple[list[int], SamplingParams]  # one request: prompt token ids and its parameters


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What /v1/models and /tokenize report."""

    name: str
    max_model_len: int


@dataclass(frozen=True, slots=True)
class HealthReport:
    """The /health body, and whether the engine can serve (200) or not (503)."""

    ok: bool
    body: dict[str, Any]


class EngineClient(Protocol):
    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def capacity(self) -> int:
        """Requests the engine holds at once (max_batch_size + max_queued_requests); a response
        needing more choices can never be seated."""
        ...

    # -- the frontend: blocking, call through off_loop from an event loop -------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids; `chat_template_kwargs` (vLLM's field, e.g. enable_thinking)
        are more variables for the template, refused (AdmissionError) unless JSON values."""
        ...

    @property
    def chat_template(self) -> str | None:
        """The Jinja template chat prompts are made with (--chat-template, else the tokenizer's),
        if one; the server reads from it which tool-call format the model was taught."""
        ...

    def detokenize(self, token_ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """Run blocking frontend work on the client's bounded worker pool."""
        ...

    # -- requests -----------------------------------------------------------------------------
    async def open_streams(
        self, jobs: Sequence[Job], block: bool = False, count_refusal: bool = True
    ) -> list[AsyncIterator[RequestOutput]]:
        """Validate and seat every job (all or none; QueueFullError when full, AdmissionError
        naming the field, EngineUnavailableError when nothing can serve); one async iterator of
        deltas each. Closing an iterator before its final delta aborts that request."""
        ...

    def abort(self, request_id: str) -> None: ...

    # -- introspection ------------------------------------------------------------------------
    def health(self) -> ExecutorHealth: ...

    def health_report(self) -> HealthReport: ...

    def stats(self) -> EngineSnapshot: ...

    def metrics_text(self) -> bytes:
        """Prometheus exposition text of the engine's `ifb:` series."""
        ...

    def retry_after_s(self) -> int:
        """Seconds a refused client should wait: until the queue ahead has likely drained."""
        ...
