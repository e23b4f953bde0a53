"""EngineSnapshot: what the executor publishes after every iteration, for any thread to read.

`/health`, `/metrics` and `LLM.stats()` read only this: a frozen value replaced whole (one
reference assignment), so readers never see a half-updated scheduler nor take its lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ifb.runtime.scheduler_stats import SchedulerCounters


@dataclass(frozen=True, slots=True)
class DiskTierUsage:
    """The prefix cache's disk tier (prefix_disk_tier.py); zeros without one."""

    hit_tokens: int = 0  # restored from disk
    miss_tokens: int = 0  # full prompt blocks an admitted request found in neither RAM nor disk
    bytes_written: int = 0
    bytes_read: int = 0
    dropped_spills: int = 0  # evictions not written: the writer's queue was full
    rejected_files: int = 0  # corrupt, truncated or foreign files, removed
    num_bytes: int = 0  # the tier's files now


@dataclass(frozen=True, slots=True)
class KvUsage:
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    disk: DiskTierUsage = field(default_factory=DiskTierUsage)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True, slots=True)
class GuidedUsage:
    num_requests: int = 0
    compile_seconds_total: float = 0.0
    compile_seconds_max: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    counters: SchedulerCounters = field(default_factory=SchedulerCounters)
    num_running: int = 0
    num_waiting: int = 0
    kv: KvUsage = field(default_factory=KvUsage)
    guided: GuidedUsage = field(default_factory=GuidedUsage)


@dataclass(frozen=True, slots=True)
class ExecutorHealth:
    """Whether the step loop can serve: running, not stuck in one step, not dead."""

    alive: bool
    stuck: bool
    error: str | None

    @property
    def ok(self) -> bool:
        return self.alive and not self.stuck and self.error is None
