"""RequestChannel: hands prepared requests to the executor and their deltas back to callers.

Owns the admission gate (max_batch_size + max_queued_requests inside the engine at once) and
one LoopMailbox per event loop; offers the three ways to consume a request: a sink callback,
a blocking iterator, an async iterator. Closing or cancelling a consumer aborts its request.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence

from ifb.runtime.admission import AdmissionGate
from ifb.runtime.executor import Executor
from ifb.runtime.frontend import PreparedRequest
from ifb.runtime.live_request import Sink
from ifb.runtime.loop_mailbox import LoopMailbox
from ifb.runtime.outputs import RequestOutput, until_final


class RequestChannel:
    def __init__(self, executor: Executor, capacity: int) -> None:
        self.executor = executor
        self.gate = AdmissionGate(capacity, on_refused=executor.count_refusal)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
        self._mailboxes_lock = threading.Lock()

    def submit(self, prepared: PreparedRequest, sink: Sink, block: bool = True, timeout: float | None = None) -> str:
        """Take a seat (or raise QueueFullError) and queue the request; `sink` gets every delta on
        the executor thread. Returns the request id."""
        self.gate.acquire(block, timeout)
        return self._enqueue(prepared, sink)

    def _enqueue(self, prepared: PreparedRequest, sink: Sink) -> str:
        """The caller already holds a gate seat; it is given back with the final delta."""

        def release_then_sink(output: RequestOutput) -> None:
            if output.finished:
                self.gate.release()
            sink(output)

        request = prepared.request
        self.executor.submit(request, release_then_sink, prepared.compiled_grammar, prepared.grammar_compile_s)
        return request.request_id

    def abort(self, request_id: str) -> None:
        self.executor.abort(request_id)

    def iterate(
        self, prepared: PreparedRequest, block: bool = True, timeout: float | None = None
    ) -> Iterator[RequestOutput]:
        """Deltas as they are produced, blocking; closing the iterator early aborts the request."""
        inbox: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        request_id = self.submit(prepared, inbox.put, block, timeout)
        return self._drain_sync(request_id, inbox)

    def _drain_sync(self, request_id: str, inbox: queue.SimpleQueue[RequestOutput]) -> Iterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = inbox.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(request_id)

    def open_streams(
        self, prepared: Sequence[PreparedRequest], block: bool = False, count_refusal: bool = True
    ) -> list[AsyncIterator[RequestOutput]]:
        """Seat several requests at once (all or none) and return one async iterator each. Call
        from a running event loop; with block=False a full engine raises QueueFullError at once."""
        loop = asyncio.get_running_loop()
        taken = 0
        try:
            for _ in prepared:
                self.gate.acquire(block, None, count_refusal)
                taken += 1
        except BaseException:
            for _ in range(taken):
                self.gate.release()
            raise
        mailbox = self._mailbox(loop)
        streams = []
        for item in prepared:
            inbox: asyncio.Queue[RequestOutput] = asyncio.Queue()
            request_id = self._enqueue(item, functools.partial(mailbox.post, inbox))
            streams.append(until_final(inbox, functools.partial(self.abort, request_id)))
        return streams

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        with self._mailboxes_lock:
            if loop not in self._mailboxes:
                self._mailboxes[loop] = LoopMailbox(loop)
            return self._mailboxes[loop]
