"""Executor: the one thread that owns the step loop (design.md §4), in a fixed order.

    1 take new requests and aborts from the inbox   2 scheduler.schedule()
    3 build_step_inputs                              4 engine.step
    5 sampler                                        6 scheduler.update (+ stop strings)
    7 push deltas to each request's sink; record step stats

Only this thread touches the scheduler, the KV manager and requests. An exception inside a
step fails that step's requests (finish reason `error`) and the loop goes on.

The engine is created on this thread too: once another thread has run OpenMP work, libgomp
has two thread teams on two cores and throttles its spin-waits, which made every compiled step
~1.8x slower (bench: 44 ms vs 80 ms for a batch-8 decode). Keep torch compute off the caller's
thread. Loop threads come from one process-wide pool (engine_threads.py) and are reused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from ifb.runtime.detokenizer import IncrementalDetokenizer
from ifb.runtime.engine_threads import run_on_engine_thread
from ifb.runtime.guided import fill_bitmask
from ifb.runtime.outputs import RequestOutput, TokenLogprob
from ifb.runtime.request import FinishReason, Request
from ifb.runtime.sampler import Sampler
from ifb.runtime.scheduler import ScheduledBatch, Scheduler
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

logger = logging.getLogger(__name__)

Sink = Callable[[RequestOutput], None]
StepListener = Callable[["StepRecord"], None]
_SUMMARY_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One iteration, for traces and metrics."""

    start: float
    end: float
    num_tokens: int
    num_requests: int
    request_ids: tuple[str, ...]
    prefill_ids: tuple[str, ...]
    num_used_blocks: int


@dataclass(frozen=True, slots=True)
class _Add:
    request: Request
    sink: Sink


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


class Executor:
    def __init__(
        self, engine_factory: Callable[[], Engine], scheduler: Scheduler, tokenizer: Any, sampler: Sampler | None = None
    ) -> None:
        self._engine_factory = engine_factory
        self.engine: Engine | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.sampler = sampler or Sampler()
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._stopping = threading.Event()
        self._loop: Future[None] | None = None
        self.step_in_progress_since: float | None = None
        self.step_listeners: list[StepListener] = []
        self.finish_listeners: list[Callable[[Request], None]] = []
        self.fatal_error: str | None = None
        self._last_summary = time.monotonic()
        self._tokens_since_summary = 0

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop; returns once the engine is loaded on the executor thread (or raises)."""
        self._loop = run_on_engine_thread(self._run)
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def submit(self, request: Request, sink: Sink) -> None:
        self._inbox.put(_Add(request, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        if self._loop is not None:
            wait([self._loop], timeout)

    @property
    def is_alive(self) -> bool:
        return self._loop is not None and not self._loop.done()

    # -- executor thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._engine_factory()
        except BaseException as error:
            self._start_error = error
            return
        finally:
            self._ready.set()
        try:
            while not self._stopping.is_set():
                self._take_inbox(block=not self.scheduler.has_work)
                if self._stopping.is_set():
                    break
                batch = self.scheduler.schedule()
                if batch.is_empty:
                    if self.scheduler.has_work:
                        time.sleep(0.001)  # only waiting requests that cannot start yet
                    continue
                self._step(batch)
                self._maybe_log_summary()
        except BaseException as error:  # the loop itself broke: /health must say so
            self.fatal_error = repr(error)
            logger.exception("executor loop died")
            raise
        finally:
            self._finish_all(FinishReason.ABORT, "server shutting down")
            self.engine = None  # the pooled thread outlives this loop; let the KV pool go

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, _Add):
                self._sinks[item.request.request_id] = item.sink
                self._detokenizers[item.request.request_id] = IncrementalDetokenizer(
                    self.tokenizer, item.request.token_ids, item.request.params.stop
                )
                self.scheduler.add(item.request)
            else:
                request = self.scheduler.abort(item.request_id)
                if request is not None:
                    self._emit_final(request)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self, batch: ScheduledBatch) -> None:
        start = time.perf_counter()
        self.step_in_progress_since = time.monotonic()
        requests = [self.scheduler.requests[item.request_id] for item in batch.requests]
        sampling = [r for r, item in zip(requests, batch.requests, strict=True) if item.sample]
        try:
            slices = [
                RequestSlice(
                    r.token_ids[r.num_computed_tokens : r.num_computed_tokens + item.num_new_tokens],
                    r.num_computed_tokens,
                    r.block_ids,
                    item.sample,
                )
                for r, item in zip(requests, batch.requests, strict=True)
            ]
            engine = self.engine
            assert engine is not None
            inputs = build_step_inputs(slices, engine.config.limits.block_size)
            guided = [(row, r.grammar_matcher) for row, r in enumerate(sampling) if r.grammar_matcher is not None]
            # Masks are filled before the step, not beside it: the step now releases the GIL, but
            # it uses both cores, so a mask thread would only take a core from it.
            bitmask = fill_bitmask(guided, len(sampling), engine.config.spec.vocab_size) if guided else None
            logits = engine.step(inputs)
            result = self.sampler.sample(logits, sampling, bitmask) if sampling else None
        except Exception as error:
            logger.exception("engine step failed; failing its %d requests", len(requests))
            for request in requests:
                self.scheduler.finish(request, FinishReason.ERROR, error=f"engine step failed: {error}")
                self._emit_final(request)
            return
        finally:
            self.step_in_progress_since = None
        sampled = {}
        logprobs: dict[str, TokenLogprob] = {}
        if result is not None:
            for row, request in enumerate(sampling):
                sampled[request.request_id] = result.token_ids[row]
                if result.logprobs is not None and result.top_logprobs is not None:
                    logprobs[request.request_id] = TokenLogprob(
                        result.token_ids[row], result.logprobs[row], result.top_logprobs[row]
                    )
        for request in self.scheduler.update(batch, sampled):
            self._emit_token(request, sampled[request.request_id], logprobs.get(request.request_id))
        self._tokens_since_summary += len(sampled)
        self._record(batch, start)

    def _emit_token(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        detok = self._detokenizers[request.request_id]
        detok.push([token])
        if detok.stopped and not request.state.is_finished:
            self.scheduler.finish(request, FinishReason.STOP)
        matcher = request.grammar_matcher
        if matcher is not None and not matcher.is_terminated():
            matcher.accept_token(token)
            if matcher.is_terminated() and not request.state.is_finished:
                self.scheduler.finish(request, FinishReason.STOP)  # the constraint is complete
        final = request.state.is_finished
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=(token,),
            new_text=detok.take(final),
            finished=final,
            finish_reason=request.finish_reason,
            logprobs=(logprob,) if logprob is not None else (),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_prefix_hit_tokens,
            **(self._timings(request) if final else {}),
        )
        self._deliver(request, output)

    def _emit_final(self, request: Request) -> None:
        detok = self._detokenizers.get(request.request_id)
        output = RequestOutput(
            request_id=request.request_id,
            new_token_ids=(),
            new_text=detok.take(True) if detok else "",
            finished=True,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_prefix_hit_tokens,
            error=request.error,
            **self._timings(request),
        )
        self._deliver(request, output)

    @staticmethod
    def _timings(request: Request) -> dict[str, float | None]:
        t = request.times
        end = t.finished or time.perf_counter()
        return {
            "ttft_s": None if t.first_token is None else t.first_token - t.arrival,
            "e2e_s": end - t.arrival,
            "queue_s": None if t.admitted is None else t.admitted - t.arrival,
        }

    def _deliver(self, request: Request, output: RequestOutput) -> None:
        sink = self._sinks.get(request.request_id)
        if output.finished:
            self._sinks.pop(request.request_id, None)
            self._detokenizers.pop(request.request_id, None)
            for listener in self.finish_listeners:
                listener(request)
        if sink is not None:
            try:
                sink(output)
            except Exception:  # a broken consumer must not take the loop down
                logger.exception("output sink of %s failed", request.request_id)

    def _record(self, batch: ScheduledBatch, start: float) -> None:
        if not self.step_listeners:
            return
        requests = self.scheduler.requests
        record = StepRecord(
            start=start,
            end=time.perf_counter(),
            num_tokens=batch.num_tokens,
            num_requests=len(batch.requests),
            request_ids=tuple(item.request_id for item in batch.requests),
            prefill_ids=tuple(
                item.request_id
                for item in batch.requests
                if item.num_new_tokens > 1
                or (item.request_id in requests and requests[item.request_id].num_output_tokens == 0)
            ),
            num_used_blocks=self.scheduler.kv.num_used_blocks,
        )
        for listener in self.step_listeners:
            listener(record)

    def _maybe_log_summary(self) -> None:
        now = time.monotonic()
        if now - self._last_summary < _SUMMARY_INTERVAL_S:
            return
        kv = self.scheduler.kv
        logger.info(
            "running %d, waiting %d, KV %.1f%% used, %.1f tokens/s",
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            100.0 * kv.num_used_blocks / kv.num_blocks,
            self._tokens_since_summary / (now - self._last_summary),
        )
        self._last_summary = now
        self._tokens_since_summary = 0

    def _finish_all(self, reason: FinishReason, error: str) -> None:
        for request in list(self.scheduler.requests.values()):
            self.scheduler.finish(request, reason, error=error)
            self._emit_final(request)
