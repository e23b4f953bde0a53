"""LLM: the Python API over one engine folder. `LLM(engine).generate(prompts, params)`; streaming
and async. A thin facade: the Frontend prepares requests, the RequestChannel seats and streams
them, the Executor runs the steps and publishes an EngineSnapshot. It is also the server's
in-process EngineClient (runtime/engine_client.py).

Calls from several threads share batches; beyond max_batch_size + max_queued_requests an extra
caller blocks (or gets QueueFullError with block=False or on timeout). Async callers never
block their event loop: tokenizing and compiling constraints run on a small worker pool.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ifb.runtime.drain_rate import DrainRate
from ifb.runtime.engine_client import HealthReport, Job
from ifb.runtime.engine_snapshot import EngineSnapshot, ExecutorHealth
from ifb.runtime.errors import AdmissionError, EngineUnavailableError, QueueFullError
from ifb.runtime.executor import Executor
from ifb.runtime.frontend import PreparedRequest, Prompt
from ifb.runtime.frontend_client import FrontendClient
from ifb.runtime.health_report import health_body
from ifb.runtime.metrics import Metrics
from ifb.runtime.outputs import CompletionOutput, RequestOutput
from ifb.runtime.policies import make_capacity_policy, make_chunking_policy
from ifb.runtime.prefix_disk_tier import make_block_tier
from ifb.runtime.request_channel import RequestChannel
from ifb.runtime.runtime_config import RuntimeSettings
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.scheduler import Scheduler, SchedulerConfig
from ifb.runtime.speculation.factory import make_speculation
from ifb.runtime.step.engine import Engine
from ifb.runtime.step_budget.budgets import (
    ConservativeBudget,
    CostModelSource,
    FixedBudget,
    StepBudget,
    make_step_budget,
)
from ifb.runtime.step_budget.cost_model import StepCostModel
from ifb.runtime.step_budget.idle_calibration import IdleCalibrator
from ifb.runtime.step_budget.serving_cost_model import CostModelInfoCollector, ServingCostModel
from ifb.runtime.trace import TraceRecorder
from ifb.runtime.windowed_kv_cache_manager import make_kv_cache_manager

# The engines loaded in this process whose objects gc.freeze() keeps out of the collector's reach
_FROZEN: weakref.WeakSet[LLM] = weakref.WeakSet()


class LLM(FrontendClient):
    def __init__(self, engine: str | Path, settings: RuntimeSettings | None = None, **overrides: Any) -> None:
        """`engine` is an engine folder; `overrides` are RuntimeSettings fields by name."""
        super().__init__(engine, dataclasses.replace(settings or RuntimeSettings(), **overrides))
        self.cost_model = ServingCostModel(self.engine_config, self.config.calibrate)
        self.executor = Executor(
            self._load_engine, self._make_scheduler(), self.tokenizer, queue_timeout_s=self.config.queue_timeout
        )
        self.channel = RequestChannel(self.executor, self.capacity)
        self.metrics = Metrics(self.executor)
        self.metrics.registry.register(CostModelInfoCollector(self.cost_model))
        self._drain = DrainRate()
        self.executor.finish_listeners.append(lambda request: self._drain.record_finish())
        self._trace = TraceRecorder.attach(self.executor) if self.settings.trace is not None else None
        self.executor.start()
        # A script that never calls close() used to end in SIGABRT ("terminate called without an
        # active exception", exit 134): the interpreter tore down native thread pools under the
        # running executor thread. Closing at exit stops the loop first; a weak reference, so
        # the hook never keeps an LLM alive.
        atexit.register(_close_if_alive, weakref.ref(self))

    def start_guided_workers(self) -> None:
        """Start guided decoding's compile workers now, in the background, so the first guided
        request finds one warm: `ifb run` and each `ifb serve` replica do at start. Otherwise the
        first guided request starts them and waits for one (its compile budget starts only when
        a worker takes it), so an LLM that never sees one costs no worker process (~280 MB, ~4 s
        of CPU to import xgrammar)."""
        self.frontend.start_grammar_compiler()

    def _make_scheduler(self) -> Scheduler:
        limits, config = self.engine_config.limits, self.config
        # With a window on every layer, blocks that slid out of it are freed as requests advance.
        kv = make_kv_cache_manager(
            config.num_kv_blocks, limits.block_size, config.enable_prefix_reuse, self.frontend.kv_window
        )
        # With --calibrate the budget is made once the engine is measured (_load_engine); until
        # then no step runs, so the fixed budget never schedules one. Without a cost model the
        # conservative budget serves until idle turns have timed one (serving_cost_model.py).
        model = self.cost_model.model
        if config.calibrate:
            budget: StepBudget = FixedBudget()
        elif model is None:
            budget = ConservativeBudget(config.max_num_tokens, limits.block_size)
        else:
            budget = self._step_budget(model)
        return Scheduler(
            SchedulerConfig(config.max_batch_size, config.max_num_tokens, limits.max_seq_len, limits.max_batch_size),
            kv,
            make_capacity_policy(config.policy, kv),
            make_chunking_policy(config.chunking),
            budget,
            speculation=make_speculation(config.speculation),
        )

    def _step_budget(self, cost_model: StepCostModel | None) -> StepBudget:
        c, block_size = self.config, self.engine_config.limits.block_size
        return make_step_budget(
            c.itl_target_ms, cost_model, c.max_batch_size, block_size, c.ttft_target_ms, c.max_num_tokens
        )

    def _load_engine(self) -> Engine:
        """On the executor thread, before its loop starts. --calibrate measures this engine (the
        KV it writes is garbage over blocks no request owns yet) instead of loading a second one."""
        engine = Engine(self.engine_config, self.settings.step_mode)
        self.executor.scheduler.kv.attach_tier(
            make_block_tier(
                self.config.prefix_disk_tier,
                self.engine_config.build_id,
                engine.kv_cache,
                self.engine_config.limits.block_size,
            )
        )
        self.executor.scheduler.speculation.prepare(self.engine_config)  # a draft engine loads here
        if self.config.calibrate:
            from ifb.runtime.step_budget.calibration import calibrate

            self._use_measured(calibrate(engine), CostModelSource.CALIBRATED_AT_START)
        elif self.cost_model.model is None:  # timed in the loop host's idle turns, then swapped in
            self.executor.idle_work = IdleCalibrator(
                engine,
                self.executor.scheduler.kv,
                lambda model: self._use_measured(model, CostModelSource.CALIBRATED_IDLE),
            )
        # What is loaded by now lives as long as the process; frozen, it is out of the cyclic
        # collector's reach. Unfrozen, a full collection traversed ~220k objects of a loaded 1B
        # engine in 120 ms, holding the GIL the step loop needs between steps (an inter-token stall).
        gc.collect()
        gc.freeze()
        _FROZEN.add(self)
        return engine

    def _use_measured(self, model: StepCostModel, source: CostModelSource) -> None:
        """On the executor's thread, between steps: the budget sizes steps with `model` from now on.
        The budget is swapped before the source is published, so /health never reports a measured
        source over the conservative budget (a CI run read the two in between, stop 52)."""
        self.executor.scheduler.step_budget = self._step_budget(model)
        self.cost_model.measured(model, source)

    @property
    def engine(self) -> Engine:
        assert self.executor.engine is not None
        return self.executor.engine

    # -- requests -----------------------------------------------------------------------------
    def prepare(self, prompt_token_ids: list[int], params: SamplingParams) -> PreparedRequest:
        """Validate (AdmissionError naming the field) and compile any constraint; refused
        (EngineUnavailableError) when the step loop cannot take requests."""
        prepared = self.frontend.prepare(prompt_token_ids, params)
        self._check_alive()
        return prepared

    def _check_alive(self) -> None:
        health = self.executor.health()
        if not health.ok:
            reason = health.error or ("a step is stuck" if health.stuck else "the step loop is not running")
            raise EngineUnavailableError(f"the engine cannot take requests: {reason}")

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None],
        block: bool = True,
        timeout: float | None = None,
    ) -> str:
        """Queue one request; `sink` gets every delta on the executor thread. Returns its id."""
        return self.channel.submit(self.prepare(prompt_token_ids, params), sink, block, timeout)

    def abort(self, request_id: str) -> None:
        self.channel.abort(request_id)

    # -- sync ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> list[CompletionOutput]:
        """One CompletionOutput per prompt, in order."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        prompt_list: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item,arg-type]
        param_list = _params_per_prompt(params, len(prompt_list))
        jobs = [(self.tokenize(prompt), p) for prompt, p in zip(prompt_list, param_list, strict=True)]
        streams = [self.channel.iterate(self.prepare(ids, p), block, timeout) for ids, p in jobs]  # all seated first
        return [
            CompletionOutput.collect(ids, list(stream), p.logprobs is not None)
            for (ids, p), stream in zip(jobs, streams, strict=True)
        ]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Deltas as they are produced; closing the iterator early aborts the request."""
        return self.channel.iterate(self.prepare(self.tokenize(prompt), params or SamplingParams()))

    # -- async --------------------------------------------------------------------------------
    async def open_streams(
        self, jobs: Sequence[Job], block: bool = False, count_refusal: bool = True
    ) -> list[AsyncIterator[RequestOutput]]:
        """Prepare (off the loop) and seat several requests at once (all or none get a seat);
        one async iterator of deltas each. With block=False a full engine raises QueueFullError."""
        prepared = await self.off_loop(lambda: [self.frontend.prepare(ids, params) for ids, params in jobs])
        self._check_alive()
        return self.channel.open_streams(prepared, block, count_refusal)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Async deltas of one request; waits for a seat without blocking the event loop."""
        params = params or SamplingParams()
        ids = await self.off_loop(self.tokenize, prompt)
        prepared = [await self.off_loop(self.prepare, ids, params)]
        while True:
            self._check_alive()
            try:
                (stream,) = self.channel.open_streams(prepared, block=False, count_refusal=False)
                break
            except QueueFullError:  # full: wait for a seat without blocking the event loop
                await asyncio.sleep(0.01)
        async for output in stream:
            yield output

    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None) -> CompletionOutput:
        params = params or SamplingParams()
        ids = await self.off_loop(self.tokenize, prompt)
        deltas = [output async for output in self.astream(ids, params)]
        return CompletionOutput.collect(ids, deltas, params.logprobs is not None)

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> EngineSnapshot:
        """The executor's latest published snapshot (scheduling counters, KV, guided usage)."""
        return self.executor.snapshot

    def health(self) -> ExecutorHealth:
        return self.executor.health()

    def health_report(self) -> HealthReport:
        health = self.health()
        budget = self.executor.scheduler.step_budget.report()
        body = health_body(self.model_name, health, self.stats(), self.engine_config, self.config, budget)
        body["step_budget"]["cost_model_source"] = self.cost_model.source.value
        return HealthReport(health.ok, body)

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    def retry_after_s(self) -> int:
        return self._drain.retry_after_s(self.stats().num_waiting + 1)  # when the queue ahead has drained

    def close(self) -> None:
        self.executor.shutdown()
        if self._trace is not None and self.settings.trace is not None:
            self._trace.write(Path(self.settings.trace))
            self._trace = None  # written once, however often close is called
        super().close()
        _FROZEN.discard(self)
        gc.unfreeze()  # what this engine held can be collected again (and is, at exit: no leak reports)
        if _FROZEN:  # other engines serve on (the model router unloads one of several): theirs stays frozen
            gc.collect()
            gc.freeze()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_if_alive(reference: weakref.ref[LLM]) -> None:
    llm = reference()
    if llm is not None:
        llm.close()


def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise AdmissionError(f"got {len(params)} SamplingParams for {n} prompts", field="params")
    return list(params)
