"""ExpertRouting: how many distinct experts a mixture-of-experts step reads, before routing is known.

A dense engine reads every weight once per step whatever its rows, so its weight reads sit in the
cost model's base. An MoE engine's grouped op (plugins/grouped_experts.py) reads each expert that
at least one of the step's rows selected, once: a step of n rows reads between k and min(E, n*k)
experts per layer, and on a CPU those reads are most of the step (bench/README.md, MoE section).
The scheduler sizes a step before its router runs, so the cost model prices the expected count
under uniform routing: each row picks k of E experts, so a given expert is missed by one row with
probability 1 - k/E and by all n rows with (1 - k/E)^n, and

    expected distinct experts = E * (1 - (1 - k/E)^n)

(k at n = 1, exact for uniform independent routing; real routers are skewed, so fewer experts are
read than this, which the fitted per-expert cost absorbs as it is calibrated on the engine itself).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExpertRouting:
    """E experts per layer, k selected per row; `ExpertRouting()` (0 experts) is a dense engine,
    whose steps read no expert."""

    num_experts: int = 0
    experts_per_token: int = 0

    def __post_init__(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts == 0 and self.experts_per_token != 0:
            raise ValueError(f"experts_per_token must be 0 without experts, got {self.experts_per_token}")
        if self.num_experts > 0 and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token must be in [1, num_experts={self.num_experts}], got {self.experts_per_token}"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def expected_distinct(self, rows: int) -> float:
        """Expected distinct experts (per layer) a step of `rows` rows reads under uniform routing."""
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        if not self.is_moe:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** rows)


DENSE = ExpertRouting()  # a dense engine's: no expert is read
