"""RuntimeConfig: the runtime's own settings, checked against the engine's baked limits."""

from __future__ import annotations

from dataclasses import dataclass

from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.errors import LimitExceededError
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind
from ifb.runtime.step.backend import StepMode


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """What a user asks of the runtime (`ifb run` flags, `LLM(...)` keywords), defined once and
    passed whole; None means the engine's baked value."""

    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    max_queued_requests: int = 64
    policy: CapacityPolicyKind = CapacityPolicyKind.GUARANTEED_NO_EVICT
    chunking: ChunkingPolicyKind = ChunkingPolicyKind.FIRST_COME_FIRST_SERVED
    enable_prefix_reuse: bool = True
    default_max_tokens: int = 512
    kv_blocks: int | None = None
    step_mode: StepMode = StepMode.COMPILED
    chat_template: str | None = None  # a Jinja template replacing the tokenizer's own
    # Inter-token latency target: None = the default from the engine's cost model (step_budget.py),
    # 0 = off (every step may take max_num_tokens), > 0 = milliseconds per step, predicted.
    itl_target_ms: float | None = None
    calibrate: bool = False  # re-measure the step cost model at start instead of engine.json's

    def __post_init__(self) -> None:  # accept the enums' string values from CLIs and callers
        object.__setattr__(self, "policy", CapacityPolicyKind(self.policy))
        object.__setattr__(self, "chunking", ChunkingPolicyKind(self.chunking))
        object.__setattr__(self, "step_mode", StepMode(self.step_mode))


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
    itl_target_ms: float | None = None  # as RuntimeSettings: None = default, 0 = off
    calibrate: bool = False


def resolve_runtime_config(engine: EngineConfig, settings: RuntimeSettings) -> RuntimeConfig:
    """Runtime values may lower a baked limit, never raise it."""
    requested = {
        "max_batch_size": settings.max_batch_size,
        "max_num_tokens": settings.max_num_tokens,
        "num_kv_blocks": settings.kv_blocks,
    }
    for name, value in requested.items():
        baked = getattr(engine.limits, name)
        if value is None:
            continue
        if value < 1:
            raise LimitExceededError(f"{name} must be >= 1, got {value}")
        if value > baked:
            build_name = "kv_blocks" if name == "num_kv_blocks" else name
            raise LimitExceededError(
                f"{name} {value} exceeds the engine's baked limit {name}={baked}; rebuild with: "
                + engine.rebuild_command(**{build_name: value})
            )
    batch = settings.max_batch_size or engine.limits.max_batch_size
    tokens = settings.max_num_tokens or engine.limits.max_num_tokens
    if tokens < batch:
        raise LimitExceededError(f"max_num_tokens {tokens} must be >= max_batch_size {batch}")
    if tokens < engine.limits.block_size:
        raise LimitExceededError(f"max_num_tokens {tokens} must be >= block_size {engine.limits.block_size}")
    if settings.max_queued_requests < 0:
        raise LimitExceededError(f"max_queued_requests must be >= 0, got {settings.max_queued_requests}")
    if settings.default_max_tokens < 1:
        raise LimitExceededError(f"default_max_tokens must be >= 1, got {settings.default_max_tokens}")
    if settings.itl_target_ms is not None and not settings.itl_target_ms >= 0:
        raise LimitExceededError(f"itl_target_ms must be >= 0 (0 = off), got {settings.itl_target_ms}")
    return RuntimeConfig(
        max_batch_size=batch,
        max_num_tokens=tokens,
        max_queued_requests=settings.max_queued_requests,
        policy=settings.policy,
        chunking=settings.chunking,
        enable_prefix_reuse=settings.enable_prefix_reuse,
        default_max_tokens=settings.default_max_tokens,
        num_kv_blocks=settings.kv_blocks or engine.limits.num_kv_blocks,
        itl_target_ms=settings.itl_target_ms,
        calibrate=settings.calibrate,
    )
