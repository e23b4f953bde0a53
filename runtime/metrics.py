"""Prometheus metrics, `ifb:`-prefixed and shaped like vLLM's, fed by the executor: gauges and
counters read from its published snapshot at scrape time, histograms observed on its thread."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ifb.runtime.executor import Executor, StepRecord
from ifb.runtime.request import Request

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
# measured / predicted - 1: 0 is a perfect prediction, 0.5 a step 50% slower than predicted.
_PREDICTION_ERROR_BUCKETS = (-0.5, -0.25, -0.1, -0.05, 0, 0.05, 0.1, 0.25, 0.5, 1, 2, 4)
_ACCEPTANCE_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)


class _SchedulerCollector(Collector):
    """Gauges and counters read from the executor's snapshot at scrape time."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self.executor.snapshot
        c, kv = snapshot.counters, snapshot.kv
        yield GaugeMetricFamily(
            "ifb:num_requests_running", "Requests in the running batch.", value=snapshot.num_running
        )
        yield GaugeMetricFamily(
            "ifb:num_requests_waiting", "Requests waiting to be admitted.", value=snapshot.num_waiting
        )
        yield GaugeMetricFamily("ifb:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", value=kv.usage)
        counters = {
            "ifb:prompt_tokens": ("Prompt tokens computed.", c.prompt_tokens),
            "ifb:generation_tokens": ("Tokens generated.", c.generation_tokens),
            "ifb:num_preemptions": ("Requests preempted (max_utilization).", c.preempted),
            "ifb:prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                kv.prefix_cache_queried_tokens,
            ),
            "ifb:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", kv.prefix_cache_hit_tokens),
            "ifb:prefix_cache_disk_hits": (
                "Prompt tokens restored from the prefix cache's disk tier.",
                kv.disk.hit_tokens,
            ),
            "ifb:prefix_cache_disk_misses": (
                "Prompt tokens of full blocks found neither in the prefix cache nor on its disk tier.",
                kv.disk.miss_tokens,
            ),
            "ifb:prefix_cache_disk_written_bytes": ("Bytes the disk tier wrote.", kv.disk.bytes_written),
            "ifb:prefix_cache_disk_read_bytes": ("Bytes the disk tier read back.", kv.disk.bytes_read),
            "ifb:prefix_cache_disk_dropped_spills": (
                "Evicted blocks not written to the disk tier: its writer's queue was full.",
                kv.disk.dropped_spills,
            ),
            "ifb:prefix_cache_disk_rejected_files": (
                "Disk-tier files refused (corrupt, truncated or another engine's) and removed.",
                kv.disk.rejected_files,
            ),
            "ifb:request_rejected": ("Requests refused with 429 (server full or queue timeout).", c.refused),
            "ifb:guided_requests": ("Requests with a guided-decoding constraint.", snapshot.guided.num_requests),
            "ifb:grammar_compile_seconds": ("Time spent compiling constraints.", snapshot.guided.compile_seconds_total),
            "ifb:spec_decode_num_drafts": ("Speculative drafts verified.", c.spec_num_drafts),
            "ifb:spec_decode_num_draft_tokens": ("Draft tokens proposed and verified.", c.spec_num_draft_tokens),
            "ifb:spec_decode_num_accepted_tokens": (
                "Draft tokens the target model agreed with.",
                c.spec_num_accepted_tokens,
            ),
            "ifb:spec_decode_num_emitted_tokens": (
                "Tokens emitted by steps that verified a draft (accepted drafts and the token after them).",
                c.spec_num_emitted_tokens,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "ifb:prefix_cache_disk_bytes", "Bytes of the disk tier's files.", value=kv.disk.num_bytes
        )


class Metrics:
    def __init__(self, executor: Executor) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(executor))
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.ttft = histogram("ifb:time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("ifb:inter_token_latency_seconds", "Mean time between tokens, per request.")
        self.e2e = histogram("ifb:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue = histogram("ifb:request_queue_time_seconds", "Arrival to admission.")
        self.finished = Counter("ifb:request_success", "Finished requests by reason.", ["finished_reason"], registry=r)
        self.step_prediction_error = histogram(
            "ifb:step_time_prediction_error_ratio",
            "Measured step time / the cost model's prediction - 1 (steps with a prediction).",
            _PREDICTION_ERROR_BUCKETS,
        )
        self.acceptance_length = histogram(
            "ifb:spec_decode_acceptance_length", "Draft tokens accepted per verified draft.", _ACCEPTANCE_BUCKETS
        )
        executor.finish_listeners.append(self.on_finish)
        executor.step_listeners.append(self.on_step)

    def text(self) -> bytes:
        """The Prometheus exposition text of every series."""
        return generate_latest(self.registry)

    def on_step(self, step: StepRecord) -> None:
        """Runs on the executor thread once per step."""
        if step.predicted_ms:
            self.step_prediction_error.observe(1000 * (step.end - step.start) / step.predicted_ms - 1)
        for draft in step.drafts:
            self.acceptance_length.observe(draft.num_accepted)

    def on_finish(self, request: Request) -> None:
        """Runs on the executor thread once per request."""
        t = request.times
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if t.last_token is not None and request.num_output_tokens > 1:
                self.itl.observe((t.last_token - t.first_token) / (request.num_output_tokens - 1))
        if t.admitted is not None:
            self.queue.observe(t.admitted - t.arrival)
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        if request.finish_reason is not None:
            self.finished.labels(request.finish_reason.value).inc()
