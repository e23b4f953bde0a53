"""Request: one generation's scheduling state, owned by the executor thread. Torch-free: the
executor's LiveRequest (live_request.py) holds it beside the sampling state, the detokenizer
and the caller's sink."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ifb.runtime.sampling_params import SamplingParams


class FinishReason(str, Enum):
    """Values are what the HTTP API returns."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Stop:
    """A decision to finish a request, with the error a client should see for ERROR."""

    reason: FinishReason
    error: str | None = None


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestState.FINISHED


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class Request:
    """Known tokens are `token_ids` (prompt, then outputs); prefill vs decode is derived, never stored.

    token_ids:  [ p0 p1 ... p(n-1) | o0 o1 ... ]
                  ^^^^^^^^^^^^^^^^^^^^^^^           num_computed_tokens (K/V in the pool)
    tokens to compute this step = num_tokens - num_computed_tokens (1 while decoding)
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int
    times: RequestTimes
    eos_token_ids: frozenset[int] = frozenset()
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    was_admitted_mid_flight: bool = False
    timed_out_in_queue: bool = False  # never admitted within the queue timeout: a 429, not an abort
    # The prefix cache's view (kv_cache_manager.py): the hash chain of the full blocks hashed so
    # far (kept across preemption: the tokens do not change), and how many blocks are published.
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    # Speculation (runtime/speculation/planner.py): decayed counts of drafts whose first token held
    # and of drafts tried, and of later draft tokens that held once the one before had held and of
    # those tried (a rejection ends a draft: the tokens after it are never tried).
    draft_accepted: float = 0.0
    draft_tried: float = 0.0
    draft_run_accepted: float = 0.0
    draft_run_tried: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_tokens_to_compute == 1 and self.num_output_tokens > 0

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens
