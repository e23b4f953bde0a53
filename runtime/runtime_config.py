"""RuntimeConfig: the runtime's own settings, checked against the engine's baked limits."""

from __future__ import annotations

from dataclasses import dataclass

from ifb.runtime.engine_config import EngineConfig
from ifb.runtime.errors import LimitExceededError
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    max_batch_size: int
    max_num_tokens: int
    max_queued_requests: int = 64
    policy: CapacityPolicyKind = CapacityPolicyKind.GUARANTEED_NO_EVICT
    chunking: ChunkingPolicyKind = ChunkingPolicyKind.FIRST_COME_FIRST_SERVED
    enable_prefix_reuse: bool = True
    # A request without max_tokens generates at most this many tokens (and never past
    # max_seq_len), so guaranteed_no_evict reserves a bounded number of blocks for it instead of
    # a whole max_seq_len -- one such request can no longer serialize the server.
    default_max_tokens: int = 512
    num_kv_blocks: int = 0  # blocks the scheduler may use, <= the engine's pool


def rebuild_command(engine: EngineConfig, **overrides: int) -> str:
    limits = {
        "max_batch_size": engine.limits.max_batch_size,
        "max_num_tokens": engine.limits.max_num_tokens,
        "max_seq_len": engine.limits.max_seq_len,
        **overrides,
    }
    source = engine.record.get("source", {}).get("path", "SOURCE")
    kv_blocks = limits.pop("num_kv_blocks", engine.limits.num_kv_blocks)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in limits.items())
    return f"ifb build {source} {flags} --kv-blocks {kv_blocks} --dtype {engine.dtype} -o {engine.folder}"


def resolve_runtime_config(
    engine: EngineConfig,
    *,
    max_batch_size: int | None = None,
    max_num_tokens: int | None = None,
    max_queued_requests: int = 64,
    policy: CapacityPolicyKind | str = CapacityPolicyKind.GUARANTEED_NO_EVICT,
    chunking: ChunkingPolicyKind | str = ChunkingPolicyKind.FIRST_COME_FIRST_SERVED,
    enable_prefix_reuse: bool = True,
    default_max_tokens: int = 512,
    kv_blocks: int | None = None,
) -> RuntimeConfig:
    """Runtime values may lower a baked limit, never raise it."""
    requested = {"max_batch_size": max_batch_size, "max_num_tokens": max_num_tokens, "num_kv_blocks": kv_blocks}
    for name, value in requested.items():
        baked = getattr(engine.limits, name)
        if value is None:
            continue
        if value < 1:
            raise LimitExceededError(f"{name} must be >= 1, got {value}")
        if value > baked:
            raise LimitExceededError(
                f"{name} {value} exceeds the engine's baked limit {name}={baked}; rebuild with: "
                + rebuild_command(engine, **{name: value})
            )
    batch = max_batch_size or engine.limits.max_batch_size
    tokens = max_num_tokens or engine.limits.max_num_tokens
    if tokens < batch:
        raise LimitExceededError(f"max_num_tokens {tokens} must be >= max_batch_size {batch}")
    if tokens < engine.limits.block_size:
        raise LimitExceededError(f"max_num_tokens {tokens} must be >= block_size {engine.limits.block_size}")
    if max_queued_requests < 0:
        raise LimitExceededError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
    if default_max_tokens < 1:
        raise LimitExceededError(f"default_max_tokens must be >= 1, got {default_max_tokens}")
    return RuntimeConfig(
        max_batch_size=batch,
        max_num_tokens=tokens,
        max_queued_requests=max_queued_requests,
        policy=CapacityPolicyKind(policy),
        chunking=ChunkingPolicyKind(chunking),
        enable_prefix_reuse=enable_prefix_reuse,
        default_max_tokens=default_max_tokens,
        num_kv_blocks=kv_blocks or engine.limits.num_kv_blocks,
    )
