"""In-flight batching end to end on a tiny compiled engine: batched output == alone output."""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from greedy_loop import greedy_generate
from waiting import StepGate, wait_until

from ifb import LLM, SamplingParams
from ifb.runtime import llm as llm_module
from ifb.runtime.errors import AdmissionError, QueueFullError
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.scheduler import ScheduledBatch
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine


def workload(seed: int, n: int = 32) -> list[tuple[list[int], int]]:
    """Random prompts (some sharing a prefix) and output lengths."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(32)]
    items = []
    for _ in range(n):
        head = shared[: rng.choice([0, 16, 32])]
        prompt = head + [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
        items.append((prompt, rng.randint(1, 20)))
    return items


@pytest.fixture(scope="module")
def alone_outputs(tiny_llama_engine: Path) -> dict[int, list[int]]:
    """Each workload request run alone through a plain greedy loop (the reference)."""
    engine = Engine.load(tiny_llama_engine, StepMode.COMPILED)
    return {i: greedy_generate(engine, prompt, n) for i, (prompt, n) in enumerate(workload(5))}


def run_arriving_over_time(llm: LLM, items: list[tuple[list[int], int]], seed: int) -> dict[int, list[int]]:
    """Submit the items one by one and let the executor take one step after about half of them
    (StepGate), so arrivals and steps interleave the same way on any machine; then run to the end."""
    rng = random.Random(seed)
    results: dict[int, list[int]] = {}
    done = threading.Event()
    lock = threading.Lock()

    def sink_for(index: int, collected: list[int]):
        def sink(output: RequestOutput) -> None:
            collected.extend(output.new_token_ids)
            if output.finished:
                assert output.finish_reason is FinishReason.LENGTH, output
                with lock:
                    results[index] = collected
                    if len(results) == len(items):
                        done.set()

        return sink

    with StepGate(llm.executor) as gate:
        granted = [0]  # steps the executor may have taken so far
        gate.allow = lambda batch: len(gate.batch_sizes) < granted[0]

        def granted_step_taken(submitted: int) -> Callable[[], bool]:  # or none can be: all ended
            return lambda: len(gate.batch_sizes) == granted[0] or len(results) == submitted

        for index, (prompt, n) in enumerate(items):
            llm.submit(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), sink_for(index, []))
            if rng.random() < 0.5:
                granted[0] += 1
                wait_until(granted_step_taken(index + 1), 30, "the granted step")
        gate.allow = lambda batch: True
        assert done.wait(120), "requests did not finish"
    return results


CONFIGS = {
    "no_evict": dict(policy="guaranteed_no_evict"),
    "max_util_small_pool": dict(policy="max_utilization", kv_blocks=16),
    "static": dict(policy="static_batch"),
    "chunked_fcfs": dict(max_num_tokens=16),
    "chunked_equal_progress": dict(max_num_tokens=16, chunking="equal_progress"),
    "no_prefix_reuse": dict(enable_prefix_reuse=False),
    "one_at_a_time": dict(max_batch_size=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_greedy_equals_alone(name: str, tiny_llama_engine: Path, alone_outputs: dict[int, list[int]]) -> None:
    """32 requests arriving over time: every output equals the same request run alone."""
    with LLM(tiny_llama_engine, **CONFIGS[name]) as llm:
        results = run_arriving_over_time(llm, workload(5), seed=9)
        stats = llm.stats()
        llm.executor.scheduler.check_integrity()
    assert results == alone_outputs
    assert stats.counters.completed == 32 and stats.kv.num_used_blocks == 0
    if name == "max_util_small_pool":
        assert stats.counters.preempted > 0
    if name in ("no_evict", "chunked_fcfs"):
        assert stats.counters.admitted_mid_flight > 0 and stats.kv.prefix_cache_hit_tokens > 0
    if name == "no_prefix_reuse":
        assert stats.kv.prefix_cache_hit_tokens == 0


def test_request_with_other_params_joins_mid_flight(tiny_llama_engine: Path) -> None:
    """A sampled request with its own max_tokens joins a running greedy one at the next step.
    The running one's second step waits for the joiner to reach the executor, so the joiner
    cannot arrive after it has finished."""
    with LLM(tiny_llama_engine) as llm, StepGate(llm.executor) as gate:
        gate.allow = lambda batch: gate.first_steps_only(batch) or len(gate.submitted) >= 2
        stream = llm.stream([5, 6, 7], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
        next(stream)
        joined = llm.generate([[9, 10]], SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=3))[0]
        rest = list(stream)
        assert rest[-1].finished and joined.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert llm.stats().counters.admitted_mid_flight == 1


def test_seeded_sampling_is_reproducible_across_batch_compositions(tiny_llama_engine: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=42, ignore_eos=True)
    with LLM(tiny_llama_engine) as llm:
        alone = llm.generate([[11, 12, 13]], params)[0].token_ids
        crowd = [[20 + i, 30] for i in range(6)]
        together = llm.generate(
            [[11, 12, 13]] + crowd, [params] + [SamplingParams(max_tokens=20, temperature=1.3, ignore_eos=True)] * 6
        )
        unseeded = llm.generate([[11, 12, 13]] * 4, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    assert together[0].token_ids == alone
    assert len({o.token_ids for o in unseeded}) > 1


def test_stop_token_stop_string_and_logprobs(tiny_llama_engine: Path) -> None:
    with LLM(tiny_llama_engine) as llm:
        base = llm.generate([[40, 41]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3))[0]
        assert len(base.logprobs) == 16 and all(len(lp.top) == 3 for lp in base.logprobs)
        assert all(
            lp.logprob <= 0 and lp.token_id == tok for lp, tok in zip(base.logprobs, base.token_ids, strict=True)
        )
        stop_at = base.token_ids[5]
        first = base.token_ids.index(stop_at)
        by_id = llm.generate(
            [[40, 41]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,))
        )[0]
        assert by_id.finish_reason is FinishReason.STOP and by_id.token_ids == base.token_ids[: first + 1]
        text = base.text
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if stop.strip():
            by_str = llm.generate(
                [[40, 41]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=(stop,))
            )[0]
            assert by_str.finish_reason is FinishReason.STOP
            assert by_str.text == text[: text.index(stop)] and stop not in by_str.text


def test_bad_params_and_limits_raise_admission_errors(tiny_llama_engine: Path) -> None:
    with LLM(tiny_llama_engine) as llm:
        for kwargs, field in [
            (dict(temperature=-1.0), "temperature"),
            (dict(top_p=0.0), "top_p"),
            (dict(max_tokens=0), "max_tokens"),
            (dict(top_k=-5), "top_k"),
            (dict(logprobs=99), "logprobs"),
        ]:
            with pytest.raises(AdmissionError) as error:
                SamplingParams(**kwargs)
            assert error.value.field == field
        with pytest.raises(AdmissionError, match="max_seq_len 256") as error:
            llm.generate([[5] * 200], SamplingParams(max_tokens=100))
        assert error.value.field == "max_tokens"
        with pytest.raises(AdmissionError, match="empty"):
            llm.generate([[]])
        with pytest.raises(AdmissionError, match="vocab size"):
            llm.generate([[5]], SamplingParams(logit_bias={10_000: 1.0}))


def test_a_request_without_max_tokens_runs_in_a_pool_smaller_than_its_default(tiny_llama_engine: Path) -> None:
    """4 blocks of 16 (64 tokens) under guaranteed_no_evict, default_max_tokens 512, max_seq_len
    256: a 10-token prompt gets max_tokens 54, what the pool holds beside it, and runs to its
    length. (Before, its default of 246 passed admission and then could never be reserved: it
    waited until the queue timeout refused it.)"""
    with LLM(tiny_llama_engine, kv_blocks=4, queue_timeout=30.0) as llm:
        (output,) = llm.generate(
            [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41]], SamplingParams(temperature=0, ignore_eos=True)
        )
    assert output.finish_reason == "length" and len(output.token_ids) == 54


def test_full_server_refuses_without_blocking(tiny_llama_engine: Path) -> None:
    """Beyond max_batch_size + max_queued_requests a non-blocking caller gets QueueFullError;
    aborted requests give their seats and blocks back."""
    with LLM(tiny_llama_engine, max_batch_size=2, max_queued_requests=1) as llm, StepGate(llm.executor) as gate:
        release = threading.Event()
        gate.allow = lambda batch: release.is_set()  # no step, so no request can end and free a seat
        params = SamplingParams(max_tokens=250, temperature=0, ignore_eos=True)
        ids = [llm.submit([5, 6], params, lambda o: None) for _ in range(3)]
        with pytest.raises(QueueFullError):
            llm.submit([5], SamplingParams(max_tokens=2), lambda o: None, block=False)
        for request_id in ids:
            llm.abort(request_id)
        release.set()

        def settled() -> bool:  # the refusal is counted by the executor, between steps
            s = llm.stats()
            return s.counters.refused == 1 and s.counters.cancelled == 3 and not (s.num_running or s.num_waiting)

        wait_until(settled, 30, "the refusal and the 3 aborts counted, nothing running")
        assert llm.stats().counters.completed == 0 and llm.stats().kv.num_used_blocks == 0
        assert llm.generate([[5]], SamplingParams(max_tokens=2), block=False)[0].finish_reason is not None


def test_calls_from_several_threads_share_batches(tiny_llama_engine: Path) -> None:
    """Four threads calling generate at once: their requests run in one batch. Steps wait until
    all four reached the executor, so a thread that starts late cannot miss the others."""
    with LLM(tiny_llama_engine) as llm, StepGate(llm.executor) as gate:
        gate.allow = lambda batch: len(gate.submitted) >= 4
        results: dict[int, tuple[int, ...]] = {}

        def call(i: int) -> None:
            results[i] = llm.generate([[20 + i, 21]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[
                0
            ].token_ids

        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        shared = max(gate.batch_sizes)
        alone = {
            i: llm.generate([[20 + i, 21]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].token_ids
            for i in range(4)
        }
    assert results == alone and shared == 4


def test_async_variants_equal_sync(tiny_llama_engine: Path) -> None:
    import asyncio

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(tiny_llama_engine, max_batch_size=2, max_queued_requests=0) as llm:
        expected = llm.generate([[30, 31]], params)[0]
        turned_away: set[str] = set()  # requests that found the engine full at least once
        open_streams = llm.channel.open_streams

        def recording_open_streams(prepared, *args, **kwargs):  # type: ignore[no-untyped-def]
            try:
                return open_streams(prepared, *args, **kwargs)
            except QueueFullError:
                turned_away.update(p.request.request_id for p in prepared)
                raise

        llm.channel.open_streams = recording_open_streams  # type: ignore[method-assign]

        async def main() -> list:
            # 4 concurrent callers on 2 seats and no queue: extra async callers wait, not fail
            return await asyncio.gather(*(llm.agenerate([30, 31], params) for _ in range(4)))

        with StepGate(llm.executor) as gate:  # the seated two wait until the other two were turned away
            gate.allow = lambda batch: len(turned_away) == 2
            results = asyncio.run(main())
        assert llm.stats().counters.refused == 0 and len(turned_away) == 2
    assert all(r.token_ids == expected.token_ids and r.text == expected.text for r in results)


def test_aborts_during_steps_finish_each_request_exactly_once(tiny_llama_engine: Path) -> None:
    """Aborts arriving while a step runs are applied before the update: the aborted request gets
    no token from that step, one final `abort` delta and nothing after it; the others run to
    length. Each abort is sent from the step-started hook (the executor thread, right before
    engine.step), so it cannot land between steps; without the executor's phase 6 the request
    would get that step's token before its abort."""
    with LLM(tiny_llama_engine, max_batch_size=4) as llm, StepGate(llm.executor) as gate:
        finished: list[str] = []
        llm.executor.finish_listeners.append(lambda request: finished.append(request.request_id))
        deltas: dict[str, list[RequestOutput]] = {}
        targets: list[str] = []
        deltas_at_abort: dict[str, int] = {}  # deltas a target had got when its abort was sent

        def abort_inside_the_step(batch: ScheduledBatch) -> None:  # deltas are written on this thread too
            for item in batch.requests:
                request_id = item.request_id
                seen = len(deltas.get(request_id, ()))
                if request_id in targets and request_id not in deltas_at_abort and seen >= 2:
                    deltas_at_abort[request_id] = seen
                    llm.abort(request_id)

        gate.allow = lambda batch: len(targets) == 3  # no step before the targets are known
        llm.executor.step_started_listeners.append(abort_inside_the_step)
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        ids = [
            llm.submit([5, 6, 7 + i], params, lambda o: deltas.setdefault(o.request_id, []).append(o)) for i in range(6)
        ]
        targets.extend(ids[::2])
        wait_until(lambda: all(deltas[r][-1].finished for r in ids), 60, "every request to end", ignoring=(KeyError,))
    # leaving the `with` shut the loop down: nothing can arrive after this point
    assert sorted(finished) == sorted(ids)  # each exactly once
    assert sorted(deltas_at_abort) == sorted(targets), "every abort was sent from inside a step"
    for request_id in ids:
        outputs = deltas[request_id]
        assert [o.finished for o in outputs].count(True) == 1 and outputs[-1].finished
        if request_id in targets:
            after_abort = outputs[deltas_at_abort[request_id] :]
            assert len(after_abort) == 1 and after_abort[0].new_token_ids == (), after_abort
            assert after_abort[0].finish_reason is FinishReason.ABORT
        else:
            assert outputs[-1].finish_reason is FinishReason.LENGTH and outputs[-1].num_output_tokens == 40


def test_what_the_engine_loaded_is_frozen_out_of_the_cyclic_collector(tiny_llama_engine: Path) -> None:
    """A full collection over a loaded engine's objects holds the GIL for ~120 ms at 1B (the step
    loop's stall); frozen at load, collections traverse only what serving allocates."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    with LLM(tiny_llama_engine) as llm:
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
        assert gc.get_freeze_count() > 10_000  # the torch, tokenizer and engine objects loaded so far


def test_trace_setting_writes_the_steps_and_requests_when_the_llm_closes(
    tiny_llama_engine: Path, tmp_path: Path
) -> None:
    """`trace` is a RuntimeSettings field, so `ifb run`, `ifb serve` (per replica) and LLM(...) share it."""
    import json

    trace = tmp_path / "steps.json"
    llm = LLM(tiny_llama_engine, trace=str(trace))
    outputs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4))
    assert not trace.exists()  # written when the engine stops, with every step in it
    llm.close()
    events = json.loads(trace.read_text())["traceEvents"]
    steps = [e for e in events if e["name"] == "step"]
    assert sum(step["args"]["tokens"] for step in steps) == 5 + 2 * 3  # both prompts, then 3 decodes each
    requests = {e["name"]: e["args"] for e in events if e["pid"] == 1 and e["ph"] == "X"}
    assert [requests[o.request_id]["output_tokens"] for o in outputs] == [4, 4]
    llm.close()  # a second close writes nothing again and does not fail


def test_each_replica_traces_to_its_own_file() -> None:
    from ifb.ray_serve.replica import replica_settings
    from ifb.runtime.runtime_config import RuntimeSettings

    assert replica_settings(RuntimeSettings(), "r1").trace is None
    assert replica_settings(RuntimeSettings(trace="/tmp/run/steps.json"), "abc").trace == "/tmp/run/steps-abc.json"


def test_closing_one_engine_keeps_the_others_frozen(tiny_llama_engine: Path) -> None:
    """A loaded engine's objects are frozen out of the cyclic collector (a full collection of a 1B
    engine held the GIL 120 ms, runtime/llm.py); closing one of two (the model router unloading
    one) must not unfreeze what the other still serves with, and closing the last unfreezes all."""
    first, second = LLM(tiny_llama_engine), LLM(tiny_llama_engine)
    try:
        assert gc.get_freeze_count() > 0
        first.close()
        assert gc.get_freeze_count() > 0
        assert second.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids
    finally:
        first.close()
        second.close()
    if not llm_module._FROZEN:  # no other test's engine is still open
        assert gc.get_freeze_count() == 0
