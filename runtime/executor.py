"""Executor: a model's step loop (docs/design.md §4), one turn at a time on the loop host, in a fixed order.

    1 take new requests and aborts from the inbox   2 scheduler.schedule()
    3 build_step_inputs                              4 engine.step
    5 sampler                                        6 aborts that arrived during the step
    7 output processor (text, stop strings, grammar) 8 scheduler.update: the one finish
    9 push deltas to each request's sink; publish the snapshot

Only this thread touches the scheduler, the KV manager and the requests. Each request's state
is one LiveRequest (live_request.py) in `_live`, created when it arrives (`_apply`) and dropped
with its final delta (`_deliver`), the one place a request leaves the executor. A request
whose own part of a step raises (its setup, guided mask, sample, text or stop strings) ends
with finish reason `error` alone; an exception in the step's shared part (the engine, the
scheduler's update) fails that step's requests. Either way the loop goes on.

The loop runs as turns on the process's one loop host thread (loop_host.py), beside every
other loaded model's loop: a second thread that has run OpenMP work keeps a second team and
libgomp then throttles both, which made every compiled step ~1.8x slower (bench: 44 ms vs 80 ms
for a batch-8 decode). The engine is created on a short-lived thread whose team ends with it, so
a load never stalls the other models' steps. Keep torch compute off the caller's thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ifb.runtime.engine_snapshot import EngineSnapshot, ExecutorHealth, GuidedUsage, KvUsage
from ifb.runtime.guided import GuidedRow, fill_bitmask
from ifb.runtime.live_request import LiveRequest, Sink
from ifb.runtime.loop_host import LOOP_HOST, Turn
from ifb.runtime.output_processor import OutputProcessor
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason, Request
from ifb.runtime.sampler import RowSample, Sampler
from ifb.runtime.sampling_state import SamplingRow, SamplingState
from ifb.runtime.scheduler import ScheduledBatch, Scheduler
from ifb.runtime.speculation.verification import VerifiedRow, cut_drafts_by_grammar, seeded_rewinds, verify_rows
from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, build_step_inputs

logger = logging.getLogger(__name__)

_SUMMARY_INTERVAL_S = 5.0
STUCK_STEP_S = 30.0  # a step running longer than this means the loop is stuck


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
    predicted_ms: float | None = None  # the scheduler's cost-model prediction for this step
    drafts: tuple[DraftRecord, ...] = ()  # speculation: each verified draft of the step


@dataclass(frozen=True, slots=True)
class DraftRecord:
    request_id: str
    num_proposed: int
    num_accepted: int


@dataclass(frozen=True, slots=True)
class _Add:
    request: Request
    sink: Sink
    compiled_grammar: Any = None  # guided.CompiledGuide of a guided request
    grammar_compile_s: float = 0.0


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Refused:
    """A caller was turned away by the admission gate: counted here, the counters' one writer."""


class IdleWork(Protocol):
    def step(self) -> bool:
        """One engine step of background work on this executor's engine; True while more remains."""
        ...


class Executor:
    def __init__(
        self,
        engine_factory: Callable[[], Engine],
        scheduler: Scheduler,
        tokenizer: Any,
        sampler: Sampler | None = None,
        queue_timeout_s: float | None = None,
    ) -> None:
        self._engine_factory = engine_factory
        self.engine: Engine | None = None
        self._start_error: BaseException | None = None
        self.scheduler = scheduler
        self.sampler = sampler or Sampler()
        self.outputs = OutputProcessor(tokenizer)
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Refused] = queue.SimpleQueue()
        self._live: dict[str, LiveRequest] = {}  # every request not yet finished, by id
        self._stopping = threading.Event()
        self._loop: Future[None] | None = None
        self._step_started: float | None = None
        self._fatal_error: str | None = None
        self._guided = GuidedUsage()
        self.snapshot = EngineSnapshot()
        self.queue_timeout_s = queue_timeout_s  # waiting longer than this before admission: refused
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        # Called on this thread with each scheduled batch just before its engine step, before the
        # stuck-step watchdog's clock starts (tests observe or hold steps here). An abort arriving
        # from here on is applied in phase 6, before the update. A raise fails the step's requests.
        self.step_started_listeners: list[Callable[[ScheduledBatch], None]] = []
        self.finish_listeners: list[Callable[[Request], None]] = []
        self._last_summary = time.monotonic()
        self._tokens_since_summary = 0
        # Background work run only in the loop host's idle turns (the step cost model timed on this
        # engine where none is stored: step_budget/idle_calibration.py); None when there is none.
        self.idle_work: IdleWork | None = None

    # -- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        """Load the engine on a short-lived thread (its OpenMP team ends with it; the caller's
        thread gets none), then hand the loop to the loop host. Raises what the load raised."""
        loader = threading.Thread(target=self._open, name="ifb-engine-load", daemon=True)
        loader.start()
        loader.join()
        if self._start_error is not None:
            raise self._start_error
        self._loop = LOOP_HOST.attach(self)
        self._publish()

    def submit(
        self, request: Request, sink: Sink, compiled_grammar: Any = None, grammar_compile_s: float = 0.0
    ) -> None:
        self._inbox.put(_Add(request, sink, compiled_grammar, grammar_compile_s))
        LOOP_HOST.wake()

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))
        LOOP_HOST.wake()

    def count_refusal(self) -> None:
        self._inbox.put(_Refused())
        LOOP_HOST.wake()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        LOOP_HOST.wake()
        if self._loop is not None and not LOOP_HOST.is_host_thread():  # the host cannot wait on itself
            wait([self._loop], timeout)

    def health(self) -> ExecutorHealth:
        alive = self._loop is not None and not self._loop.done()
        started = self._step_started
        stuck = started is not None and time.monotonic() - started > STUCK_STEP_S
        return ExecutorHealth(alive=alive, stuck=stuck, error=self._fatal_error)

    # -- loader thread, then the loop host's thread -------------------------------------------
    def _open(self) -> None:
        try:
            self.engine = self._engine_factory()
        except BaseException as error:  # start() raises it on the caller's thread
            self._start_error = error

    def turn(self) -> Turn:
        """One iteration of the loop: new requests and aborts, then at most one step."""
        try:
            self._take_inbox()
            if self._stopping.is_set():
                return Turn.ENDED
            self._expire_waiting()
            batch = self.scheduler.schedule()
            if batch.is_empty:
                self._publish()
                return Turn.WAITING if self.scheduler.has_work else Turn.IDLE  # waiting: none can start yet
            self._step(batch)  # publishes the snapshot itself, before the step's deltas
            self._maybe_log_summary()
            return Turn.STEPPED
        except BaseException as error:  # the loop itself broke: every entry point must see it
            self._fatal_error = repr(error)
            logger.exception("executor loop died")
            raise

    def idle_turn(self) -> bool:
        """One step of the idle work, when every loaded model is idle (loop_host.py). A failure
        drops the work, logged once; the loop serves on without it."""
        work = self.idle_work
        if work is None or self._stopping.is_set():
            return False
        try:
            if not work.step():
                self.idle_work = None
        except Exception:
            logger.exception("idle work failed; dropping it")
            self.idle_work = None
        return True

    def close(self) -> None:
        """After the last turn (the loop host calls it on a thread of its own)."""
        self._finish_all(FinishReason.ABORT if self._fatal_error is None else FinishReason.ERROR)
        self._close_kv()
        self.engine = None  # let the KV pool go
        self._publish()

    def _take_inbox(self) -> None:
        try:
            while True:
                self._apply(self._inbox.get_nowait())
        except queue.Empty:
            return

    def _apply(self, item: _Add | _Abort | _Refused) -> None:
        if isinstance(item, _Add):
            self._add(item)
        elif isinstance(item, _Abort):
            live = self._live.get(item.request_id)
            if live is not None and self.scheduler.abort(live.request):
                self._deliver(live, self.outputs.final_output(live))
        else:
            self.scheduler.stats.refused += 1

    def _add(self, item: _Add) -> None:
        request = item.request
        self.scheduler.add(request)
        if item.compiled_grammar is not None:
            self._count_guided(item.grammar_compile_s)
        try:
            sampling = SamplingState.create(request.params.seed, item.compiled_grammar)
            detokenizer = self.outputs.detokenizer(request)
        except Exception as error:  # this request's grammar or tokenizer: it fails alone
            logger.exception("setting up %s failed", request.request_id)
            self.scheduler.finish(request, FinishReason.ERROR, error=f"setting up the request failed: {_named(error)}")
            self._announce_finish(request)
            _send(item.sink, self.outputs.failed_output(request))
            return
        self._live[request.request_id] = LiveRequest(request, sampling, detokenizer, item.sink)

    def _expire_waiting(self) -> None:
        timeout = self.queue_timeout_s
        if timeout is None:
            return
        for request in self.scheduler.expire_waiting(time.perf_counter() - timeout):
            live = self._live[request.request_id]
            self._deliver(live, self.outputs.final_output(live))

    def _count_guided(self, seconds: float) -> None:
        g = self._guided
        self._guided = GuidedUsage(
            g.num_requests + 1, g.compile_seconds_total + seconds, max(g.compile_seconds_max, seconds)
        )

    def _step(self, batch: ScheduledBatch) -> None:
        """One step. A fault of one request's own part (its sample, guided mask, text, stop
        strings) ends that request alone; a fault of the step's shared part (the engine, the
        scheduler's update) fails the step's requests. The loop goes on either way."""
        start = time.perf_counter()
        try:
            self._run_step(batch, start)
        except Exception as error:
            logger.exception("step failed; failing its %d requests", len(batch.requests))
            for item in batch.requests:
                if item.request_id in self._live:  # not delivered yet
                    self._end(item.request, FinishReason.ERROR, f"the step failed: {_named(error)}")
            self._publish()

    def _run_step(self, batch: ScheduledBatch, start: float) -> None:
        batch = cut_drafts_by_grammar(batch, self._live)
        sampling = [(self._live[item.request_id], item) for item in batch.requests if item.sample]
        rows = [
            SamplingRow(live.request, live.sampling, item.draft_token_ids[:position])
            for live, item in sampling
            for position in range(item.num_sample_rows)
        ]
        logits, bitmask, failed = self._run_engine(batch, rows)
        for request_id, error in failed.items():  # like an abort during the step: its rows are not read
            self._end(self._live[request_id].request, FinishReason.ERROR, error)
        rewinds = seeded_rewinds(sampling, logits.shape[1])
        samples = self._sample(logits, rows, bitmask) if rows else []
        self._take_inbox()  # aborts that arrived during the step, before the update
        verified = verify_rows(sampling, samples, rewinds)
        kept = [v for v in verified if not v.live.request.state.is_finished]
        # Token stops first (eos, max_tokens): no text is made for tokens after them.
        for v in kept:
            v.keep(self.scheduler.tokens_before_stop(v.live.request, v.tokens))
        text_stops = self.outputs.process((v.live, v.tokens) for v in kept)
        for v in kept:
            if v.request_id in text_stops:
                v.keep(text_stops[v.request_id].num_tokens)
        sampled = {v.request_id: v.tokens for v in kept}
        stops = {request_id: text_stop.stop for request_id, text_stop in text_stops.items()}
        produced = {r.request_id for r in self.scheduler.update(batch, sampled, stops)}
        outputs = [
            (v.live, self.outputs.token_output(v.live, v.tokens, v.logprobs)) for v in kept if v.request_id in produced
        ]
        self._publish()  # before the deltas: a caller that saw its last token sees it counted too
        for live, output in outputs:
            self._deliver(live, output)
        self._tokens_since_summary += sum(len(v.tokens) for v in kept)
        self.scheduler.observe_step(batch, (time.perf_counter() - start) * 1e3)  # if it was predicted
        self._record(batch, start, verified)

    def _run_engine(
        self, batch: ScheduledBatch, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, str]]:
        """The step's logits, its guided mask, and the requests whose mask failed (id: why)."""
        for listener in self.step_started_listeners:
            listener(batch)
        self._step_started = time.monotonic()
        try:
            slices = [
                RequestSlice(item.step_token_ids, r.num_computed_tokens, r.block_ids, item.sample, item.num_sample_rows)
                for item in batch.requests
                for r in [item.request]
            ]
            engine = self.engine
            assert engine is not None
            inputs = build_step_inputs(slices, engine.config.limits.block_size)
            guided = [
                GuidedRow(i, row.state.grammar_matcher, row.pending)
                for i, row in enumerate(rows)
                if row.state.grammar_matcher
            ]
            # Masks are filled before the step, not beside it: the step releases the GIL, but it
            # uses both cores, so a mask thread would only take a core from it.
            bitmask, failed = (
                self._guided_bitmask(guided, rows, engine.config.spec.vocab_size) if guided else (None, {})
            )
            return engine.step(inputs), bitmask, failed
        finally:
            self._step_started = None

    def _guided_bitmask(
        self, guided: list[GuidedRow], rows: list[SamplingRow], vocab_size: int
    ) -> tuple[torch.Tensor, dict[str, str]]:
        """The guided rows' mask. If a matcher raises, the rows are filled one by one, so a
        request whose grammar fails takes only itself down (its row left open, never read)."""
        try:
            return fill_bitmask(guided, len(rows), vocab_size), {}
        except Exception:
            logger.exception("filling the guided mask failed; filling its %d rows one by one", len(guided))
        bitmask = fill_bitmask([], len(rows), vocab_size)  # every token allowed
        failed: dict[str, str] = {}
        for row in guided:
            request_id = rows[row.row].request.request_id
            try:
                if request_id not in failed:
                    bitmask[row.row] = fill_bitmask([replace(row, row=0)], 1, vocab_size)[0]
            except Exception as error:
                failed[request_id] = f"the guided-decoding mask failed: {_named(error)}"
        return bitmask, failed

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None) -> list[RowSample]:
        """One token per row. If the batch cannot be sampled, each row is sampled alone, so a row
        whose parameters fail takes only itself down: it ends with `error`, the others go on."""
        try:
            return self.sampler.sample(logits, rows, bitmask).rows()
        except Exception:
            logger.exception("sampling the batch failed; sampling its %d rows one by one", len(rows))
        samples = []
        for index, row in enumerate(rows):
            if row.request.state.is_finished:  # an earlier row of its draft failed
                samples.append(RowSample(-1, None))
                continue
            mask = None if bitmask is None else bitmask[index : index + 1]
            try:
                samples += self.sampler.sample(logits[index : index + 1], [row], mask).rows()
            except Exception as error:
                self._end(row.request, FinishReason.ERROR, f"sampling failed: {type(error).__name__}: {error}")
                samples.append(RowSample(-1, None))  # never read: the request has finished
        return samples

    def _end(self, request: Request, reason: FinishReason, error: str) -> None:
        """Finish a request outside a token (a failed step or sample, shutdown) and deliver its end."""
        self.scheduler.finish(request, reason, error=error)
        live = self._live[request.request_id]
        self._deliver(live, self.outputs.final_output(live))

    def _deliver(self, live: LiveRequest, output: RequestOutput) -> None:
        if output.finished:  # the one place a request's state is dropped
            del self._live[live.request_id]
            self._announce_finish(live.request)
        _send(live.sink, output)

    def _announce_finish(self, request: Request) -> None:
        for listener in self.finish_listeners:
            listener(request)

    def _publish(self) -> None:
        """Replace the snapshot whole: readers on other threads see one consistent value."""
        kv = self.scheduler.kv
        self.snapshot = EngineSnapshot(
            counters=self.scheduler.stats.freeze(),
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv=KvUsage(
                num_blocks=kv.num_blocks,
                num_free_blocks=kv.num_free_blocks,
                num_used_blocks=kv.num_used_blocks,
                num_cached_blocks=kv.num_cached_blocks,
                prefix_cache_queried_tokens=kv.prefix_queried_tokens,
                prefix_cache_hit_tokens=kv.prefix_hit_tokens,
                disk=kv.tier.usage(),
            ),
            guided=self._guided,
        )

    def _record(self, batch: ScheduledBatch, start: float, verified: list[VerifiedRow]) -> None:
        if not self.step_listeners:
            return
        record = StepRecord(
            start=start,
            end=time.perf_counter(),
            num_tokens=batch.num_tokens,
            num_requests=len(batch.requests),
            request_ids=tuple(item.request_id for item in batch.requests),
            prefill_ids=tuple(
                item.request_id
                for item in batch.requests
                if item.num_prompt_chunk_tokens
                or (not item.request.state.is_finished and item.request.num_output_tokens == 0)
            ),
            num_used_blocks=self.scheduler.kv.num_used_blocks,
            predicted_ms=batch.predicted_ms,
            drafts=tuple(DraftRecord(v.request_id, len(v.draft), v.num_accepted) for v in verified if v.draft),
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

    def _close_kv(self) -> None:
        """While the pool still lives: its cached blocks go to the prefix cache's disk tier, if any."""
        try:
            self.scheduler.kv.close()
        except Exception:  # shutting down regardless
            logger.exception("closing the KV cache's tier failed")

    def _finish_all(self, reason: FinishReason) -> None:
        error = "server shutting down" if reason is FinishReason.ABORT else f"the step loop died: {self._fatal_error}"
        for live in list(self._live.values()):
            self._end(live.request, reason, error)


def _send(sink: Sink, output: RequestOutput) -> None:
    try:
        sink(output)
    except Exception:  # a broken consumer must not take the loop down
        logger.exception("output sink of %s failed", output.request_id)


def _named(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
