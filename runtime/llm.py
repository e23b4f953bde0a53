"""LLM: the Python API. `LLM(engine_or_source).generate(prompts, params)`; streaming and async.

Calls from several threads share batches; beyond max_batch_size + max_queued_requests an extra
caller blocks (or gets QueueFullError with block=False or on timeout).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ifb.runtime.admission import AdmissionGate, check_prompt
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import AdmissionError, QueueFullError
from ifb.runtime.executor import Executor
from ifb.runtime.guided import GrammarCompiler
from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.loop_mailbox import LoopMailbox
from ifb.runtime.outputs import CompletionOutput, RequestOutput
from ifb.runtime.policies import make_capacity_policy, make_chunking_policy
from ifb.runtime.request import Request, RequestTimes
from ifb.runtime.runtime_config import RuntimeConfig, RuntimeSettings, resolve_runtime_config
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.scheduler import Scheduler, SchedulerConfig
from ifb.runtime.step.engine import Engine

Prompt = str | list[int]


class LLM:
    def __init__(self, engine: str | Path, settings: RuntimeSettings | None = None, **overrides: Any) -> None:
        """`engine` is an engine folder; `overrides` are RuntimeSettings fields by name."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.settings = dataclasses.replace(settings or RuntimeSettings(), **overrides)
        self.engine_config = EngineConfig.load(engine)
        self.config: RuntimeConfig = resolve_runtime_config(self.engine_config, self.settings)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.engine_config.tokenizer_path))
        limits = self.engine_config.limits
        kv = KVCacheManager(self.config.num_kv_blocks, limits.block_size, self.config.enable_prefix_reuse)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_batch_size, self.config.max_num_tokens, limits.max_seq_len),
            kv,
            make_capacity_policy(self.config.policy, kv),
            make_chunking_policy(self.config.chunking),
        )
        self.executor = Executor(
            lambda: Engine(self.engine_config, self.settings.step_mode), self.scheduler, self.tokenizer
        )
        self.gate = AdmissionGate(self.config.max_batch_size + self.config.max_queued_requests)
        self.eos_token_ids = frozenset(self.engine_config.spec.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._grammars: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
        self._mailboxes_lock = threading.Lock()
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        self.executor.start()

    @property
    def engine(self) -> Engine:
        assert self.executor.engine is not None
        return self.executor.engine

    @property
    def model_name(self) -> str:
        return self.engine_config.model_name

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        vocab = self.engine_config.spec.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise AdmissionError(f"prompt token ids must be integers in [0, {vocab})", field="prompt")
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise AdmissionError("this engine's tokenizer has no chat template", field="messages")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def make_request(self, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Validate against the engine's limits; raises AdmissionError naming the field."""
        limits = self.engine_config.limits
        params.check_vocab(self.engine_config.spec.vocab_size)
        check_prompt(
            len(prompt_token_ids), params.max_tokens, limits.max_seq_len, self.config.num_kv_blocks, limits.block_size
        )
        room = limits.max_seq_len - len(prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else min(self.config.default_max_tokens, room)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        matcher = self.grammar_compiler().matcher(params.guided) if params.guided is not None else None
        return Request(
            request_id=f"req-{self._id_prefix}-{next(self._ids)}",
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            times=RequestTimes(arrival=time.perf_counter()),
            eos_token_ids=self.eos_token_ids,
            generator=generator,
            grammar_matcher=matcher,
        )

    def grammar_compiler(self) -> GrammarCompiler:
        """Created on first use, so servers without guided requests never load xgrammar."""
        with self._grammar_lock:
            if self._grammars is None:
                stop = sorted(self.eos_token_ids)
                self._grammars = GrammarCompiler(self.tokenizer, self.engine_config.spec.vocab_size, stop)
            return self._grammars

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: Callable[[RequestOutput], None],
        block: bool = True,
        timeout: float | None = None,
    ) -> str:
        """Queue one request; `sink` gets every delta on the executor thread. Returns its id."""
        request = self.make_request(prompt_token_ids, params)
        self.gate.acquire(block, timeout)
        return self._enqueue(request, sink)

    def _enqueue(self, request: Request, sink: Callable[[RequestOutput], None]) -> str:
        """Hand a validated request to the executor; the caller already holds a gate seat."""

        def release_then_sink(output: RequestOutput) -> None:
            if output.finished:
                self.gate.release()
            sink(output)

        self.executor.submit(request, release_then_sink)
        return request.request_id

    def abort(self, request_id: str) -> None:
        self.executor.abort(request_id)

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
        param_list = self._params_per_prompt(params, len(prompt_list))
        inboxes: list[queue.SimpleQueue[RequestOutput]] = []
        token_lists = [self.tokenize(p) for p in prompt_list]
        for ids, p in zip(token_lists, param_list, strict=True):
            inbox: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
            self.submit(ids, p, inbox.put, block, timeout)
            inboxes.append(inbox)
        results = []
        for ids, p, inbox in zip(token_lists, param_list, inboxes, strict=True):
            deltas = [inbox.get()]
            while not deltas[-1].finished:
                deltas.append(inbox.get())
            results.append(CompletionOutput.collect(ids, deltas, p.logprobs is not None))
        return results

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Deltas as they are produced; closing the iterator early aborts the request."""
        inbox: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        request_id = self.submit(self.tokenize(prompt), params or SamplingParams(), inbox.put)
        finished = False
        try:
            while not finished:
                output = inbox.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    # -- async --------------------------------------------------------------------------------
    def open_streams(
        self,
        jobs: Sequence[tuple[list[int], SamplingParams]],
        block: bool = True,
        timeout: float | None = None,
        count_refusal: bool = True,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Validate and enqueue several requests at once (all or none get a seat); returns one
        async iterator of deltas each. Call from a running event loop.

        With block=False a full server raises QueueFullError at once (the HTTP 429 path).
        """
        loop = asyncio.get_running_loop()
        requests = [self.make_request(ids, params) for ids, params in jobs]
        taken = 0
        try:
            for _ in requests:
                self.gate.acquire(block, timeout, count_refusal)
                taken += 1
        except BaseException:
            for _ in range(taken):
                self.gate.release()
            raise
        mailbox = self._mailbox(loop)
        streams = []
        for request in requests:
            inbox: asyncio.Queue[RequestOutput] = asyncio.Queue()
            self._enqueue(request, functools.partial(mailbox.post, inbox))
            streams.append(self._drain(request.request_id, inbox))
        return streams

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        with self._mailboxes_lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = LoopMailbox(loop)
            return mailbox

    async def _drain(self, request_id: str, inbox: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Cancelling or closing the consumer aborts the request inside the engine."""
        finished = False
        try:
            while not finished:
                output = await inbox.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Async deltas of one request; waits for a seat without blocking the event loop."""
        ids = self.tokenize(prompt)
        params = params or SamplingParams()
        self.make_request(ids, params)  # validate before waiting for a seat
        while True:
            try:
                (stream,) = self.open_streams([(ids, params)], block=False, count_refusal=False)
                break
            except QueueFullError:  # full: wait for a seat without blocking the event loop
                await asyncio.sleep(0.01)
        async for output in stream:
            yield output

    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None) -> CompletionOutput:
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        deltas = [output async for output in self.astream(ids, params)]
        return CompletionOutput.collect(ids, deltas, params.logprobs is not None)

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The scheduling counters (Edge-LLM's /health block and more)."""
        kv = self.scheduler.kv
        data = self.scheduler.stats.snapshot()
        data.update(
            refused=self.gate.refused,
            queued=len(self.scheduler.waiting),
            resident=len(self.scheduler.running),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_cached=kv.num_cached_blocks,
            prefix_cache_queried_tokens=kv.prefix_queried_tokens,
            prefix_cache_hit_tokens=kv.prefix_hit_tokens,
            guided_requests=self._grammars.num_compiled if self._grammars else 0,
            grammar_compile_seconds_total=self._grammars.compile_seconds_total if self._grammars else 0.0,
            grammar_compile_seconds_max=self._grammars.compile_seconds_max if self._grammars else 0.0,
        )
        return data

    def close(self) -> None:
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if len(params) != n:
            raise AdmissionError(f"got {len(params)} SamplingParams for {n} prompts", field="params")
        return list(params)
