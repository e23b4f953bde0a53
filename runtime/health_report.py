"""The /health body of one engine: the Edge-LLM seed's scheduling block (its key names, `queued`
and `resident`, are that API's) plus limits, KV and guided figures, all read from the published
snapshot. The server returns it as the engine client hands it over (runtime/engine_client.py)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.engine_snapshot import EngineSnapshot, ExecutorHealth
from ifb.runtime.runtime_config import RuntimeConfig
from ifb.runtime.step_budget.budgets import StepBudgetReport

# The counters the scheduling block reports under their own names (the Edge-LLM seed's keys).
_SCHEDULING_COUNTERS = (
    "submitted completed cancelled failed refused admitted_mid_flight preempted "
    "stalls_no_capacity stalls_token_budget stalls_batch_full"
).split()


def scheduling_block(snapshot: EngineSnapshot) -> dict[str, Any]:
    c = snapshot.counters
    return {
        **{name: getattr(c, name) for name in _SCHEDULING_COUNTERS},
        "queue_latency_avg_us": int(c.queue_latency_avg_s * 1e6),
        "queue_latency_max_us": int(c.queue_latency_max_s * 1e6),
        "queued": snapshot.num_waiting,
        "resident": snapshot.num_running,
    }


def speculative_block(snapshot: EngineSnapshot, config: RuntimeConfig) -> dict[str, Any]:
    """What speculation is set to and how its drafts fare: over the server's life so far, and
    the acceptance rate of about the last 100 drafts (`recent_acceptance_rate`)."""
    c, spec = snapshot.counters, config.speculation
    return {
        "method": spec.method.value,
        "num_speculative_tokens": spec.num_speculative_tokens if spec.enabled else None,
        "draft_engine": spec.draft_engine,
        "num_drafts": c.spec_num_drafts,
        "num_draft_tokens": c.spec_num_draft_tokens,
        "num_accepted_tokens": c.spec_num_accepted_tokens,
        "acceptance_rate": round(c.spec_num_accepted_tokens / c.spec_num_draft_tokens, 4)
        if c.spec_num_draft_tokens
        else None,
        "recent_acceptance_rate": round(c.spec_recent_accepted_tokens / c.spec_recent_draft_tokens, 4)
        if c.spec_recent_draft_tokens
        else None,
        "mean_accepted_length": round(c.spec_num_accepted_tokens / c.spec_num_drafts, 3) if c.spec_num_drafts else None,
        "tokens_per_step": round(c.generation_tokens / c.num_steps, 3) if c.num_steps else None,
    }


def engine_block(engine: EngineConfig) -> dict[str, Any]:
    """How the engine computes: what a user comparing speed or quality needs to know."""
    return {
        "backend": engine.backend.value,
        "dtype": engine.dtype,
        "kv_dtype": engine.kv_dtype,
        "weight_formats": sorted({fmt.value for fmt in engine.weight_formats.values()}),
        "weight_compute": engine.weight_compute.value if engine.weight_formats else None,
        "kernels_isa": None if engine.kernels is None else engine.kernels.isa,
    }


def health_body(
    model: str,
    health: ExecutorHealth,
    snapshot: EngineSnapshot,
    engine: EngineConfig,
    config: RuntimeConfig,
    budget: StepBudgetReport,
) -> dict[str, Any]:
    kv, guided = snapshot.kv, snapshot.guided
    limits = engine.limits
    return {
        "status": "ok" if health.ok else "unhealthy",
        "executor": {"alive": health.alive, "stuck": health.stuck, "error": health.error},
        "model": model,
        "in_flight_batching": config.max_batch_size > 1,
        "max_num_seqs": config.max_batch_size,
        "engine_limits": limits.to_json(),
        "engine": engine_block(engine),
        "runtime_limits": {
            "max_batch_size": config.max_batch_size,
            "max_num_tokens": config.max_num_tokens,
            "max_queued_requests": config.max_queued_requests,
            "policy": config.policy.value,
            "chunking": config.chunking.value,
            "enable_prefix_reuse": config.enable_prefix_reuse,
        },
        "scheduling": scheduling_block(snapshot),
        # the active inter-token target (None = off: the fixed max_num_tokens budget), the cost
        # model steps are predicted with, and chunked steps' measured/predicted ratio learned while
        # serving (the budget divides by it)
        "step_budget": budget.to_json(),
        "kv_cache": {
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.num_free_blocks,
            "kv_blocks_used": kv.num_used_blocks,
            "kv_blocks_cached": kv.num_cached_blocks,
            "prefix_cache_queried_tokens": kv.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens,
            # the disk tier (--prefix-cache-dir); zeros without one
            **{f"prefix_cache_disk_{name}": value for name, value in asdict(kv.disk).items()},
        },
        "speculative": speculative_block(snapshot, config),
        "guided": {
            "guided_requests": guided.num_requests,
            "grammar_compile_seconds_total": guided.compile_seconds_total,
            "grammar_compile_seconds_max": guided.compile_seconds_max,
        },
    }
