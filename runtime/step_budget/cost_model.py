"""StepCostModel: an engine step's predicted time from the shape of its batch (torch-free).

    predicted_ms = base_ms
                 + per_prefill_token_ms     * prefill tokens          (rows with query_len > 1)
                 + per_decode_row_ms        * decode rows             (query_len == 1)
                 + per_decode_context_ms    * decode context tokens   (sum of decode seq_lens)
                 + per_prefill_pair_ms      * prefill attended pairs  (sum over prefill tokens of
                                                                       the keys each attends to)
                 + per_expert_ms            * expected distinct experts read per layer by the
                                              step's rows (MoE engines only: expert_reads.py)

Linear layers cost per row, whatever the row is; attention costs per key a query reads, and the
two attention paths (single-query decode vs causal context chunk) run different kernels, so each
gets its own coefficient. A mixture of experts also reads each expert its rows selected once per
step, a count that grows with the rows but saturates at E (expert_reads.py): priced by rows alone,
a model fitted across batch sizes overprices small steps and underprices large ones. Dense engines
have no expert term (`routing` is ExpertRouting(): 0), and their JSON is what it was before it.
Fitted by `fit` on steps timed on this machine (step/calibration.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from ifb.runtime.step_budget.expert_reads import DENSE, ExpertRouting


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

    @property
    def num_rows(self) -> int:
        """Rows through the step's linear layers (and so its experts): every token computed."""
        return self.num_prefill_tokens + self.num_decode_rows

    def features(self) -> tuple[float, ...]:
        """1 (for base_ms), then every field in order: the dense coefficients of StepCostModel."""
        return (1.0, *(float(getattr(self, f.name)) for f in fields(self)))


@dataclass(frozen=True, slots=True)
class StepCostModel:
    base_ms: float
    per_prefill_token_ms: float
    per_decode_row_ms: float
    per_decode_context_ms: float
    per_prefill_pair_ms: float
    max_relative_error: float = 0.0  # worst |predicted - measured| / measured over the fit points
    per_expert_ms: float = 0.0  # per expected distinct expert read per layer (0 for dense engines)
    routing: ExpertRouting = DENSE

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Every coefficient, in the order of `features`."""
        dense = (self.base_ms, self.per_prefill_token_ms, self.per_decode_row_ms, self.per_decode_context_ms)
        return (*dense, self.per_prefill_pair_ms, self.per_expert_ms)

    def features(self, shape: StepShape) -> tuple[float, ...]:
        """The shape's own features, then the experts its rows are expected to read."""
        return _features(shape, self.routing)

    def predict_ms(self, shape: StepShape) -> float:
        return sum(c * x for c, x in zip(self.coefficients, self.features(shape), strict=True))

    def max_prefill_tokens(self, target_ms: float, decode: StepShape, prefill_start: int) -> int:
        """The largest prefill chunk (one request starting at `prefill_start`, beside the decode
        rows of `decode`) whose predicted step stays within `target_ms`; 0 if none does.

        Solves  pair * P^2/2 + (token + pair * (start + 1/2)) * P <= target - fixed  for P, which
        bounds several chunks too: chunks starting earlier than `prefill_start` read fewer keys.
        The chunk's rows also read more experts: that term is increasing in P but not polynomial,
        so the root of the rest (an upper bound) is narrowed by bisection on the whole prediction."""
        spare = target_ms - self.predict_ms(decode)
        if spare <= 0:
            return 0
        quadratic = self.per_prefill_pair_ms / 2
        linear = self.per_prefill_token_ms + self.per_prefill_pair_ms * (prefill_start + 0.5)
        if quadratic <= 0:
            bound = int(spare / linear) if linear > 0 else 1 << 30
        else:
            bound = int((-linear + math.sqrt(linear * linear + 4 * quadratic * spare)) / (2 * quadratic))
        return self._largest_chunk_within(target_ms, decode, prefill_start, bound)

    def _largest_chunk_within(self, target_ms: float, decode: StepShape, prefill_start: int, bound: int) -> int:
        """The largest P <= bound whose step (P tokens from `prefill_start` beside `decode`) is
        predicted within `target_ms`; `bound` itself where there is no expert term to add."""
        if self.per_expert_ms <= 0 or not self.routing.is_moe:
            return bound

        def fits(chunk: int) -> bool:
            pairs = decode.num_prefill_pairs + StepShape.prefill_pairs(prefill_start, chunk)
            shape = replace(decode, num_prefill_tokens=decode.num_prefill_tokens + chunk, num_prefill_pairs=pairs)
            return self.predict_ms(shape) <= target_ms

        low, high = 0, bound  # fits(low); the prediction only grows with the chunk
        if fits(high):
            return high
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    # -- engine.json --------------------------------------------------------------------------
    def to_json(self) -> dict[str, float]:
        """The fields; an MoE model adds its expert term and routing (a dense one's record is
        exactly what engines wrote before experts existed, so cached fits keep their checksums)."""
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name in _DENSE_FIELDS}
        if self.routing.is_moe:
            record["per_expert_ms"] = self.per_expert_ms
            record["num_experts"] = self.routing.num_experts
            record["experts_per_token"] = self.routing.experts_per_token
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> StepCostModel:
        """A record of either kind; one without the expert keys (every dense engine's) is dense."""
        values = {name: float(record[name]) for name in _DENSE_FIELDS if name in record}
        routing = ExpertRouting(int(record.get("num_experts", 0)), int(record.get("experts_per_token", 0)))
        return cls(**values, per_expert_ms=float(record.get("per_expert_ms", 0.0)), routing=routing)

    # -- fitting ------------------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]], routing: ExpertRouting = DENSE) -> StepCostModel:
        """Least squares on relative error, every coefficient >= 0; `routing`: the engine's experts
        (a dense engine's expert column is all 0, so its coefficient stays 0).

        Relative, not absolute: a 1 s prefill step would otherwise outweigh every 20 ms decode
        step, and the decode steps are the ones a latency target is about. A coefficient that
        comes out negative (noise on a term this engine barely pays for) is pinned at 0 and the
        rest refitted: a negative cost would let the budget grow a chunk past the target."""
        rows = [(_features(shape, routing), ms) for shape, ms in samples]
        active = list(range(len(_features(StepShape(), routing))))
        while True:
            solution = _weighted_least_squares(rows, active)
            negative = [i for i in active if solution[i] < 0]
            if not negative:
                break
            active.remove(min(negative, key=lambda i: solution[i]))
        base, prefill_token, decode_row, decode_context, prefill_pair, per_expert = solution
        model = cls(
            base, prefill_token, decode_row, decode_context, prefill_pair, per_expert_ms=per_expert, routing=routing
        )
        worst = max((abs(model.predict_ms(s) - ms) / ms for s, ms in samples), default=0.0)
        return replace(model, max_relative_error=worst)


_DENSE_FIELDS = (
    "base_ms",
    "per_prefill_token_ms",
    "per_decode_row_ms",
    "per_decode_context_ms",
    "per_prefill_pair_ms",
    "max_relative_error",
)


def _features(shape: StepShape, routing: ExpertRouting) -> tuple[float, ...]:
    return (*shape.features(), routing.expected_distinct(shape.num_rows))


def _weighted_least_squares(samples: Sequence[tuple[tuple[float, ...], float]], active: list[int]) -> list[float]:
    """Normal equations over the `active` features, each row weighted by 1/measured."""
    size = len(active)
    gram = [[0.0] * size for _ in range(size)]
    rhs = [0.0] * size
    for x, measured_ms in samples:
        w = 1.0 / (measured_ms * measured_ms)
        for i, a in enumerate(active):
            rhs[i] += w * x[a] * measured_ms
            for j, b in enumerate(active):
                gram[i][j] += w * x[a] * x[b]
    solved = _solve(gram, rhs)
    full = [0.0] * len(samples[0][0])
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
