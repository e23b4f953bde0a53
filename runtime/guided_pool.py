"""Guided decoding's grammar compiler: xgrammar in warm worker processes, a budget per compile.

Importing xgrammar pulls in torch and transformers (about 4 s of CPU), so a worker is started
when the LLM starts, in the background, and a compile is only ever handed to a worker that is
already up. A request that finds no idle worker waits for one, in arrival order, as a request
waits for a seat; its budget (`guided_compile_timeout`) starts when a worker takes its compile.
It used to start before the first worker existed, and on a busy 2-core machine the spawn alone
took it all: the first guided request was refused though its grammar compiled in milliseconds
(issue #41). A compile past its budget is cancelled by killing that worker alone (an xgrammar
compile cannot be interrupted in a thread) and a fresh one starts in the background. The pool
keeps one worker to spare (idle or starting) beyond the requests waiting, up to COMPILE_WORKERS.
Workers exit with the process that started them, however it ends.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from ifb.runtime.errors import AdmissionError, EngineUnavailableError
from ifb.runtime.guided import CompiledGuide, GuidedDecoding, GuideKind, SurrogateGuard, compile_constraint
from ifb.runtime.parent_watch import exit_with_parent

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0  # the default budget of one compile, from when a warm worker takes it
CACHE_LIMIT_BYTES = 256 << 20
COMPILE_WORKERS = 2  # compile processes: bounded concurrency, each with its own cache
_READY, _FAILED, _COMPILED, _INVALID = "ready", "failed", "compiled", "invalid"  # worker -> pool


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def serve_compiles(fd: int, parent_pid: int) -> None:
    """A compile worker's whole life (its own interpreter, on one end of a socket pair): read the
    vocabulary, load xgrammar, say ready, then compile what comes."""
    exit_with_parent(parent_pid)
    conn = Connection(fd)
    try:
        tokenizer_info_json = conn.recv()
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
    except Exception as error:
        conn.send((_FAILED, _first_line(error)))
        return
    conn.send((_READY, ""))
    while True:
        try:
            kind, spec = conn.recv()
        except EOFError:
            return  # the pool closed its end
        try:
            text = str(compile_constraint(compiler, GuideKind(kind), spec).serialize_json())
        except Exception as error:  # xgrammar reports parse errors as RuntimeError/ValueError
            conn.send((_INVALID, _first_line(error)))
        else:
            conn.send((_COMPILED, text))


class _Worker:
    """One compile process and the parent's end of its socket.

    A fresh interpreter that imports this module, not a multiprocessing child: multiprocessing's
    spawn runs the parent's main script again in the child, so a script without an
    `if __name__ == "__main__"` guard would load a second engine inside its compile worker.
    """

    def __init__(self, tokenizer_info_json: str) -> None:
        ours, theirs = socket.socketpair()
        code = f"from ifb.runtime.guided_pool import serve_compiles; serve_compiles({theirs.fileno()}, {os.getpid()})"
        with theirs:  # the worker's end lives in the worker only, so its exit reads as EOF here
            self.process = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL
            )
        self.conn = Connection(ours.detach())
        self.conn.send(tokenizer_info_json)  # read before the worker imports xgrammar
        self._kill_lock = threading.Lock()
        self._socket_closed = False

    def exit_code(self) -> int | None:
        try:
            return self.process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self) -> str | None:
        """None once the worker is up, else why it is not (it exited, or xgrammar failed to load)."""
        try:
            status, detail = self.conn.recv()
        except (EOFError, OSError):
            return f"the worker exited while starting (exit code {self.exit_code()})"
        return None if status == _READY else str(detail)

    def compile(self, kind: str, spec: str, budget_s: float) -> tuple[str, str] | None:
        """(status, serialized grammar or error) or None when the budget ran out first. EOFError
        or OSError when the worker died."""
        self.conn.send((kind, spec))  # the worker is idle in recv(): it takes the job at once
        if not self.conn.poll(budget_s):
            return None
        status, detail = self.conn.recv()
        return str(status), str(detail)

    def stop(self) -> None:
        """End the process, from any thread: a thread reading its socket then reads EOF and kills
        the worker itself. The socket stays open, so that thread never reads a closed descriptor."""
        self.process.kill()
        self.exit_code()

    def kill(self) -> None:
        """End the process and close the socket, once, by the thread that holds the worker. Two
        closes raced here (the pool's close and a starting worker's own failure path): the second
        os.close raised EBADF in `ifb-grammar-start`, or closed whatever descriptor the server had
        opened under that number in between."""
        with self._kill_lock:
            if self._socket_closed:
                return
            self._socket_closed = True
            self.stop()
            self.conn.close()


class WorkerPool:
    """Warm compile workers handed out in arrival order. `tokenizer_info_json` blocks until the
    vocabulary is loaded; `start_gate`, when given, holds every worker start until it is set."""

    def __init__(
        self,
        tokenizer_info_json: Callable[[], str],
        max_workers: int = COMPILE_WORKERS,
        start_gate: threading.Event | None = None,
    ) -> None:
        self._info_json = tokenizer_info_json
        self._max_workers = max_workers
        self._start_gate = start_gate
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()  # started processes (idle, compiling or starting), for close()
        self._queue: deque[object] = deque()  # waiting requests' tickets, oldest first
        self._num_workers = 0  # idle + compiling + starting
        self._num_starting = 0
        self._failure: str | None = None  # why the last start failed; cleared by the next request
        self._closed = False
        with self._cond:
            self._keep_spare()

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a worker."""
        with self._cond:
            return len(self._queue)

    @property
    def num_ready(self) -> int:
        """Workers up (idle or compiling)."""
        with self._cond:
            return self._num_workers - self._num_starting

    @property
    def num_starting(self) -> int:
        """Workers whose start has not finished (held, spawning or loading xgrammar)."""
        with self._cond:
            return self._num_starting

    def worker_pids(self) -> list[int]:
        with self._cond:
            return [worker.process.pid for worker in self._live]

    def _keep_spare(self) -> None:
        """Start workers (under the lock) until one is spare beyond the waiting requests."""
        wanted = len(self._queue) + 1
        while (
            not self._closed
            and self._failure is None
            and len(self._idle) + self._num_starting < wanted
            and self._num_workers < self._max_workers
        ):
            self._start_one()

    def _start_one(self) -> None:
        self._num_workers += 1
        self._num_starting += 1
        threading.Thread(target=self._start_worker, name="ifb-grammar-start", daemon=True).start()

    def _start_worker(self) -> None:
        failure: str | None = None
        worker: _Worker | None = None
        try:
            if self._start_gate is not None:
                self._start_gate.wait()
            info_json = self._info_json()
            with self._cond:
                closed = self._closed
            if not closed:
                worker = _Worker(info_json)
                with self._cond:
                    self._live.add(worker)  # before any wait, so close() can kill it
                    closed = self._closed
                failure = "the pool closed" if closed else worker.wait_ready()
        except Exception as error:  # the vocabulary failed to load, or the process to spawn
            failure = _first_line(error)
        with self._cond:
            self._num_starting -= 1
            kept = failure is None and worker is not None and not self._closed
            if kept and worker is not None:
                self._idle.append(worker)
            else:
                self._num_workers -= 1
                if worker is not None:
                    self._live.discard(worker)
                if not self._closed:
                    self._failure = failure
                    logger.warning("a grammar compile worker failed to start: %s", failure)
            self._cond.notify_all()
        if not kept and worker is not None:  # failed, or up after the pool closed
            worker.kill()

    def acquire(self, field: str) -> _Worker:
        """The next idle worker, in arrival order; waits while workers start (not part of any
        budget). AdmissionError naming `field` when no worker can start."""
        ticket = object()
        with self._cond:
            if self._failure is not None and not self._num_starting:
                self._failure = None  # each new request tries a start again
            self._queue.append(ticket)
            try:
                while not (self._idle and self._queue[0] is ticket):
                    if self._closed:
                        raise EngineUnavailableError("the grammar compiler is closed")
                    self._keep_spare()
                    if self._failure is not None and not self._num_workers:  # none up, none starting
                        raise AdmissionError(f"{field}: no grammar compile worker could start: {self._failure}", field)
                    self._cond.wait()
                worker = self._idle.pop()
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may be at the head now
            self._keep_spare()
            return worker

    def release(self, worker: _Worker) -> None:
        with self._cond:
            if self._closed:
                worker.kill()
            else:
                self._idle.append(worker)
            self._cond.notify_all()

    def discard(self, worker: _Worker) -> None:
        """Kill `worker` (cancelling its compile) and start a replacement in the background."""
        worker.kill()
        with self._cond:
            self._live.discard(worker)
            self._num_workers -= 1
            if not self._closed and self._failure is None:
                self._start_one()
            self._cond.notify_all()

    def close(self) -> None:
        """Kill every worker now, a compile in progress included; waiting requests are refused.
        Idle workers are the pool's to kill; a starting or compiling worker's process is stopped
        here and its socket closed by the thread reading it, which reads EOF."""
        with self._cond:
            self._closed = True
            idle = list(self._idle)
            held = [worker for worker in self._live if worker not in idle]
            self._live.clear()
            self._idle.clear()
            self._cond.notify_all()
        for worker in idle:
            worker.kill()
        for worker in held:
            worker.stop()


class GrammarCompiler:
    """Compiles a request's constraint in a warm worker within `budget_s`. The vocabulary is
    loaded and the first worker started in the background from construction on."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        budget_s: float = COMPILE_TIMEOUT_S,
        start_gate: threading.Event | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.budget_s = budget_s
        self._vocabulary: Future[tuple[Any, str, SurrogateGuard]] = Future()
        threading.Thread(
            target=self._load_vocabulary, args=(tokenizer, stop_token_ids), name="ifb-grammar-vocab", daemon=True
        ).start()
        self.pool = WorkerPool(lambda: self._vocabulary.result()[1], start_gate=start_gate)

    def _load_vocabulary(self, tokenizer: Any, stop_token_ids: list[int]) -> None:
        try:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids
            )
            guard = SurrogateGuard.from_vocab(info.decoded_vocab, self.vocab_size)
            self._vocabulary.set_result((info, info.serialize_json(), guard))
        except Exception as error:
            self._vocabulary.set_exception(error)

    def compile(self, guide: GuidedDecoding) -> tuple[CompiledGuide, float]:
        """(the compiled constraint, seconds its compile took); AdmissionError naming the field
        when the constraint is invalid or its compile runs past the budget. Waits for a worker
        first when none is idle. Cached per distinct constraint by each worker."""
        import xgrammar as xgr

        worker = self.pool.acquire(guide.field)
        start = time.perf_counter()
        try:
            outcome = worker.compile(guide.kind.value, guide.spec, self.budget_s)
        except (EOFError, OSError):  # it died (a crash, or killed from outside)
            code = worker.exit_code()
            self.pool.discard(worker)
            raise AdmissionError(
                f"{guide.field}: the constraint compiler's worker ended (exit code {code}) while compiling it",
                field=guide.field,
            ) from None
        seconds = time.perf_counter() - start
        if outcome is None:
            self.pool.discard(worker)
            raise AdmissionError(
                f"{guide.field}: the constraint did not compile within {self.budget_s:g}s (guided_compile_timeout)",
                field=guide.field,
            )
        self.pool.release(worker)
        status, detail = outcome
        if status != _COMPILED:
            raise AdmissionError(f"{guide.field}: invalid {guide.kind.value}: {detail}", field=guide.field)
        info, _, guard = self._vocabulary.result()
        return CompiledGuide(xgr.CompiledGrammar.deserialize_json(detail, info), guard), seconds

    def close(self) -> None:
        """Stop the workers now, a compile in progress included (its request is going away)."""
        self.pool.close()
