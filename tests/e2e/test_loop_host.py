"""Loaded models share the cores through one loop host (runtime/loop_host.py): every model's steps
run on the same thread, in turns, and loading a model leaves no OpenMP team behind.

Why it matters: a second thread that has run OpenMP work keeps its team of workers, and libgomp
then throttles every team's spin-wait; on 2 cores that made each step ~1.6x slower even while
the second model sat idle."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import ifb.runtime.llm as llm_module
from ifb import LLM
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.scheduler import ScheduledBatch
from ifb.runtime.step.engine import Engine

PROMPT = "The quick brown fox"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def record_steps(llm: LLM, name: str, log: list[tuple[str, int]]) -> Callable[[ScheduledBatch], None]:
    def seen(batch: ScheduledBatch) -> None:
        log.append((name, threading.get_ident()))  # list.append is atomic; one thread writes anyway

    llm.executor.step_started_listeners.append(seen)
    return seen


def generate_together(llms: list[LLM]) -> None:
    """Each LLM generates on its own caller thread at the same time."""
    callers = [threading.Thread(target=llm.generate, args=([PROMPT], GREEDY)) for llm in llms]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()


def test_two_models_step_on_one_thread_in_turns(tiny_llama_engine: Path, tiny_qwen2_engine: Path) -> None:
    log: list[tuple[str, int]] = []
    with LLM(tiny_llama_engine) as llama, LLM(tiny_qwen2_engine) as qwen:
        record_steps(llama, "llama", log)
        record_steps(qwen, "qwen", log)
        generate_together([llama, qwen])
    threads = {ident for _, ident in log}
    assert len(threads) == 1, f"steps ran on {len(threads)} threads"
    assert threads != {threading.get_ident()}
    names = [name for name, _ in log]
    assert names.count("llama") >= 16 and names.count("qwen") >= 16
    # While both have work (from the second model's first step to the first model's last) a
    # rotation gives each one step: no model takes two steps in a row.
    both = names[max(names.index("llama"), names.index("qwen")) : min(_last(names, "llama"), _last(names, "qwen")) + 1]
    assert len(both) >= 8, names  # 16 tokens each, started together: most steps overlap
    repeats = [i for i in range(1, len(both)) if both[i] == both[i - 1]]
    assert not repeats, f"a model stepped twice in a row while the other had work: {names}"


def test_an_engine_loads_on_a_thread_that_ends(tiny_llama_engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's torch work (weights, the step package, a --calibrate run) gives its thread an
    OpenMP team: a thread that ends takes the team with it; the caller's or a pooled thread
    would keep it beside the loop host's for the life of the process."""
    loaders: list[threading.Thread] = []

    class RecordingEngine(Engine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            loaders.append(threading.current_thread())
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(llm_module, "Engine", RecordingEngine)
    with LLM(tiny_llama_engine) as llm:
        (loader,) = loaders
        assert loader is not threading.current_thread()
        assert not loader.is_alive(), f"the engine was loaded on {loader.name}, which is still running"
        log: list[tuple[str, int]] = []
        record_steps(llm, "llama", log)
        llm.generate([PROMPT], GREEDY)
    assert {ident for _, ident in log} != {loader.ident}


def _last(names: list[str], name: str) -> int:
    return len(names) - 1 - names[::-1].index(name)
