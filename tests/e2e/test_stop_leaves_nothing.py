"""A stopped server leaves no process behind: `ifb run` stopped by SIGTERM, SIGINT or SIGKILL
with a grammar compiled and a stream in flight, `ifb serve` (Ray) stopped by SIGTERM (serving or
starting) or SIGKILL, and a Python script that exits without closing its LLM.

Each test starts the real CLI in a subprocess, records its whole process tree (compile workers,
multiprocessing's resource tracker, Ray's daemons and agents) before the signal, and waits for
every one of them to be gone. Survivors are killed afterwards, so a failing run leaves nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from server_harness import free_port
from waiting import wait_until

START_TIMEOUT_S = 180  # a cold start imports torch (and Ray) on a busy 2-core machine
GONE_TIMEOUT_S = 60  # upper bound for the whole tree to exit; workers poll their parent every second
IFB = [sys.executable, "-m", "ifb.cli.main"]
POLL: dict[str, Any] = dict(ignoring=(httpx.HTTPError, ValueError), every_s=0.2)  # not up yet: "not yet"


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _answers(started: Started) -> bool:
    """The server answers /health at all (an `ifb serve` ingress says 503 until a replica is up)."""
    assert started.server.poll() is None, f"the server exited with {started.server.returncode}"
    return httpx.get(started.base + "/health", timeout=5).status_code in (200, 503)


def _describe(processes: list[psutil.Process]) -> str:
    def one(process: psutil.Process) -> str:
        try:
            return f"{process.pid} {' '.join(process.cmdline())[:120]}"
        except psutil.Error:
            return str(process.pid)

    return "; ".join(one(p) for p in processes)


@dataclass(frozen=True, slots=True)
class Started:
    """A CLI server in a subprocess, and every process of its tree seen so far."""

    server: subprocess.Popen[bytes]
    base: str
    seen: list[psutil.Process] = field(default_factory=list)

    def tree(self) -> list[psutil.Process]:
        """The server and all its descendants now (remembered for the clean-up)."""
        root = psutil.Process(self.server.pid)
        processes = [root, *root.children(recursive=True)]
        self.seen.extend(processes)
        return processes


@contextmanager
def cli_server(*args: str) -> Iterator[Started]:
    """`ifb ARGS --port P` in a subprocess, ready to answer /health. Whatever of its tree
    outlives the test is killed, so a failing run does not leave 300 MB workers behind."""
    port = free_port()
    server = subprocess.Popen([*IFB, *args, "--port", str(port)], stdin=subprocess.DEVNULL)
    started = Started(server, f"http://127.0.0.1:{port}", [psutil.Process(server.pid)])
    try:
        wait_until(lambda: _answers(started), START_TIMEOUT_S, "the server to answer", **POLL)
        yield started
    finally:
        if _alive(started.seen[0]):
            started.tree()
        for process in started.seen:
            if _alive(process):
                process.kill()
        server.wait(30)


def compile_workers(tree: list[psutil.Process]) -> list[psutil.Process]:
    """The grammar compile workers (runtime/guided_pool.py: interpreters running serve_compiles)."""
    return [p for p in tree if any("serve_compiles" in part for part in p.cmdline())]


def guided_request(base: str) -> None:
    """A guided_choice completion, compiled by a worker process the server started with it: the
    request waits for that worker's start (importing xgrammar, slow on a busy machine)."""
    body = {"prompt": "pick", "max_tokens": 4, "guided_choice": ["yes", "no"]}
    response = httpx.post(base + "/v1/completions", json=body, timeout=START_TIMEOUT_S)
    assert response.status_code == 200, response.text


@contextmanager
def stream_in_flight(base: str) -> Iterator[None]:
    """A long guided stream, read by a background thread; yields once its first chunk came."""
    body = {
        "prompt": "count",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "guided_regex": "[a-z ]{1,400}",
    }
    first = threading.Event()

    def read() -> None:
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        json.loads(line[len("data: ") :])
                        first.set()
        except httpx.HTTPError:
            pass  # the server went away mid-stream: what the test does
        finally:
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(120), "no first chunk"
    yield
    reader.join(GONE_TIMEOUT_S)


def assert_all_gone(
    server: subprocess.Popen[bytes],
    tree: list[psutil.Process],
    what: str,
    timeout_s: float = GONE_TIMEOUT_S,
    scale_with_load: bool = True,
) -> None:
    def gone() -> bool:
        server.poll()  # reap our own child, so it is not counted as a zombie forever
        return not any(_alive(p) for p in tree)

    try:
        wait_until(gone, timeout_s, what, every_s=0.2, scale_with_load=scale_with_load)
    except AssertionError as error:
        raise AssertionError(f"{error}; still alive: {_describe([p for p in tree if _alive(p)])}") from None


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_ifb_run_stopped_mid_stream_leaves_no_process(tiny_llama_engine: Path, stop: signal.Signals) -> None:
    """With grammar-compile workers started and a guided stream in flight, one signal to the
    `ifb run` process ends every process of its tree (the workers notice a parent killed by
    SIGKILL, which no handler sees)."""
    with cli_server("run", str(tiny_llama_engine)) as started:
        guided_request(started.base)
        with stream_in_flight(started.base):
            tree = started.tree()
            assert compile_workers(tree), f"no compile workers in {_describe(tree)}"
            os.kill(started.server.pid, stop)
            assert_all_gone(started.server, tree, f"every process of `ifb run` to exit after {stop.name}")


# Ray's own clean-up after a killed driver: its dashboard and runtime-env agents wait out a 60 s
# raylet timeout. `ifb serve`'s reaper stops them within a scan period plus a 5 s grace, so a
# bound well under Ray's timeout tells the two apart whatever the machine's load.
SERVE_KILLED_GONE_S = 30


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_ifb_serve_stopped_leaves_no_process(tiny_llama_engine: Path, stop: signal.Signals) -> None:
    """`ifb serve` with one replica that compiled a grammar: SIGTERM ends the local Ray instance
    it started (GCS, raylet, dashboard and runtime-env agents, workers) and the replica's compile
    workers; after SIGKILL, which no handler sees, its reaper does, well before Ray's own 60 s."""
    pytest.importorskip("ray.serve")
    args = ("serve", str(tiny_llama_engine), "--replicas", "1", "--threads-per-replica", "1")
    with cli_server(*args) as started:

        def one_ready() -> Any:
            return httpx.get(started.base + "/health", timeout=5).json().get("num_ready") == 1

        wait_until(one_ready, START_TIMEOUT_S, "the replica to be ready", **POLL)
        guided_request(started.base)
        tree = started.tree()
        assert compile_workers(tree), f"no compile workers in {_describe(tree)}"
        assert _ray_agents(tree), f"no Ray agents in {_describe(tree)}"
        os.kill(started.server.pid, stop)
        killed = stop == signal.SIGKILL  # then the bound is the claim: gone before Ray's own 60 s timeout
        bound = SERVE_KILLED_GONE_S if killed else GONE_TIMEOUT_S
        what = f"every process of `ifb serve` to exit after {stop.name}"
        assert_all_gone(started.server, tree, what, bound, scale_with_load=not killed)


def _ray_agents(tree: list[psutil.Process]) -> list[psutil.Process]:
    """The local Ray instance's daemons: what outlived a killed `ifb serve` before its reaper."""
    names = ("gcs_server", "raylet", "dashboard_agent", "runtime_env")

    def is_ray(process: psutil.Process) -> bool:
        try:
            return any(name in " ".join(process.cmdline()) for name in names)
        except psutil.Error:
            return False

    return [p for p in tree if is_ray(p)]


def test_ifb_serve_stopped_by_sigterm_during_start_up_leaves_no_process(tiny_llama_engine: Path) -> None:
    """SIGTERM while `ifb serve` is still starting its Ray instance (its GCS is up, no replica
    yet) ends every process it started, instead of meeting Python's default action or Ray's
    aborting handler before shutdown() runs."""
    pytest.importorskip("ray.serve")
    args = ("serve", str(tiny_llama_engine), "--replicas", "1", "--threads-per-replica", "1")
    server = subprocess.Popen([*IFB, *args, "--port", str(free_port())], stdin=subprocess.DEVNULL)
    started = Started(server, "", [psutil.Process(server.pid)])
    try:
        wait_until(lambda: _ray_agents(started.tree()), START_TIMEOUT_S, "Ray's daemons to start", every_s=0.05)
        tree = started.tree()
        os.kill(server.pid, signal.SIGTERM)
        assert_all_gone(server, tree, "every process of a starting `ifb serve` to exit after SIGTERM")
    finally:
        for process in started.seen:
            if _alive(process):
                process.kill()
        server.wait(30)


_SCRIPT_WITHOUT_CLOSE = """
import atexit, sys
from ifb.runtime.llm import LLM
from ifb.runtime.sampling_params import SamplingParams

# registered before the LLM's own hook, so it runs after it (atexit is last in, first out)
atexit.register(lambda: print("executor loop alive at exit:", llm.executor.health().alive, flush=True))
llm = LLM(sys.argv[1])
print(llm.generate("hello", SamplingParams(max_tokens=3, temperature=0))[0].text, flush=True)
"""


def test_a_python_script_that_never_closes_its_llm_exits_cleanly(tiny_q4_gguf_int8_engine: Path) -> None:
    """The Python API used as most scripts use it (no close(), no `with`): the executor loop is
    stopped at interpreter exit, before native teardown. With a block-quantized engine (kernel
    library loaded) the teardown under a live loop aborted about 1 exit in 4 (SIGABRT, exit
    134, "terminate called without an active exception"); the loop's state is checked directly
    because the abort itself is a race."""
    command = [sys.executable, "-c", _SCRIPT_WITHOUT_CLOSE, str(tiny_q4_gguf_int8_engine)]
    script = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
    assert script.returncode == 0, script.stderr[-2000:]
    assert "executor loop alive at exit: False" in script.stdout, script.stdout
    assert "terminate called" not in script.stderr
