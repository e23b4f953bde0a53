"""StepCostModel: an engine step's predicted time from the shape of its batch (torch-free).

    predicted_ms = base_ms
                 + per_prefill_token_ms     * prefill tokens          (rows with query_len > 1)
                 + per_decode_row_ms        * decode rows             (query_len == 1)
                 + per_decode_context_ms    * decode context tokens   (sum of decode seq_lens)
                 + per_prefill_pair_ms      * prefill attended pairs  (sum over prefill tokens of
                                                                       the keys each attends to)

Linear layers cost per row, whatever the row is; attention costs per key a query reads, and the
two attention paths (single-query decode vs causal context chunk) run different kernels, so each
gets its own coefficient. Fitted by `fit` on steps timed on this machine (step/calibration.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost depends on; `prefill_pairs` counts causal attention work."""

    num_prefill_tokens: int = 0
    num_decode_rows: int = 0
    num_decode_context_tokens: int = 0
    num_prefill_pairs: int = 0

    @staticmethod
    def prefill_pairs(start: int, num_tokens: int) -> int:
        """Keys read by a chunk of `num_tokens` after `start` cached ones (causal within it)."""
        return num_tokens * start + num_tokens * (num_tokens + 1) // 2

    def features(self) -> tuple[float, ...]:
        """1 (for base_ms), then every field in order: one per coefficient of StepCostModel."""
        return (1.0, *(float(getattr(self, f.name)) for f in fields(self)))


@dataclass(frozen=True, slots=True)
class StepCostModel:
    base_ms: float
    per_prefill_token_ms: float
    per_decode_row_ms: float
    per_decode_context_ms: float
    per_prefill_pair_ms: float
    max_relative_error: float = 0.0  # worst |predicted - measured| / measured over the fit points

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Every field but the fit's error, in the order of StepShape.features."""
        return tuple(getattr(self, f.name) for f in fields(self) if f.name != "max_relative_error")

    def predict_ms(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, shape.features(), strict=True))

    def max_prefill_tokens(self, target_ms: float, decode: StepShape, prefill_start: int) -> int:
        """The largest prefill chunk (one request starting at `prefill_start`, beside the decode
        rows of `decode`) whose predicted step stays within `target_ms`; 0 if none does.

        Solves  pair * P^2/2 + (token + pair * (start + 1/2)) * P <= target - fixed  for P, which
        bounds several chunks too: chunks starting earlier than `prefill_start` read fewer keys."""
        spare = target_ms - self.predict_ms(decode)
        if spare <= 0:
            return 0
        quadratic = self.per_prefill_pair_ms / 2
        linear = self.per_prefill_token_ms + self.per_prefill_pair_ms * (prefill_start + 0.5)
        if quadratic <= 0:
            return int(spare / linear) if linear > 0 else 1 << 30
        return int((-linear + math.sqrt(linear * linear + 4 * quadratic * spare)) / (2 * quadratic))

    # -- engine.json --------------------------------------------------------------------------
    def to_json(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StepCostModel:
        return cls(**{f.name: float(record[f.name]) for f in fields(cls) if f.name in record})

    # -- fitting ------------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]]) -> StepCostModel:
        """Least squares on relative error, every coefficient >= 0.

        Relative, not absolute: a 1 s prefill step would otherwise outweigh every 20 ms decode
        step, and the decode steps are the ones a latency target is about. A coefficient that
        comes out negative (noise on a term this engine barely pays for) is pinned at 0 and the
        rest refitted: a negative cost would let the budget grow a chunk past the target."""
        active = list(range(len(StepShape().features())))
        while True:
            solution = _weighted_least_squares(samples, active)
            negative = [i for i in active if solution[i] < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: solution[i]))
        model = cls(*solution)
        worst = max((abs(model.predict_ms(s) - ms) / ms for s, ms in samples), default=0.0)
        return replace(model, max_relative_error=worst)


def _weighted_least_squares(samples: Sequence[tuple[StepShape, float]], active: list[int]) -> list[float]:
    """Normal equations over the `active` features, each row weighted by 1/measured."""
    size = len(active)
    gram = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    for shape, measured_ms in samples:
        x = shape.features()
        w = 1.0 / (measured_ms * measured_ms)
        for i, a in enumerate(active):
            rhs[i] += w * x[a] * measured_ms
            for j, b in enumerate(active):
                gram[i][j] += w * x[a] * x[b]
    solved = _solve(gram, rhs)
    full = [0.0] * len(StepShape().features())
    for i, a in enumerate(active):
        full[a] = solved[i]
    return full


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a singular column (a feature no sample
    varies) gets 0. Features differ by orders of magnitude, so columns are scaled first."""
    n = len(rhs)
    scale = [math.sqrt(matrix[i][i]) or 1.0 for i in range(n)]
    a = [[matrix[i][j] / (scale[i] * scale[j]) for j in range(n)] + [rhs[i] / scale[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-12:
            continue
        for row in range(n):
            if row != col:
                factor = a[row][col] / a[col][col]
                a[row] = [v - factor * p for v, p in zip(a[row], a[col], strict=True)]
    return [(a[i][n] / a[i][i] if abs(a[i][i]) >= 1e-12 else 0.0) / scale[i] for i in range(n)]
