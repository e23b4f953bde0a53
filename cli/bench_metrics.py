"""Benchmark math: per-request timings -> percentiles, throughput, goodput."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class RequestTiming:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    admitted: float | None = None
    finished: float | None = None
    num_tokens: int = 0
    ok: bool = True

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def queue(self) -> float | None:
        return None if self.admitted is None else self.admitted - self.arrival


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    itl_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        """`ttft=0.5,itl=0.05` (seconds; `ms` suffix allowed)."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for part in text.split(","):
            key, _, raw = part.partition("=")
            raw = raw.strip()
            scale = 1e-3 if raw.endswith("ms") else 1.0
            try:
                values[key.strip()] = float(raw.removesuffix("ms").removesuffix("s")) * scale
            except ValueError:
                raise ValueError(f"SLO {text!r}: use ttft=SECONDS,itl=SECONDS") from None
        unknown = set(values) - {"ttft", "itl"}
        if unknown:
            raise ValueError(f"SLO {text!r}: unknown keys {sorted(unknown)}")
        return cls(values.get("ttft"), values.get("itl"))

    def met_by(self, timing: RequestTiming) -> bool:
        if not timing.ok or timing.ttft is None:
            return False
        if self.ttft_s is not None and timing.ttft > self.ttft_s:
            return False
        itls = timing.itls
        return not (self.itl_s is not None and itls and sum(itls) / len(itls) > self.itl_s)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN without values."""
    return float(np.percentile(values, q)) if len(values) else math.nan


def summarize(timings: Sequence[RequestTiming], wall_s: float, slo: Slo) -> dict[str, float]:
    done = [t for t in timings if t.ok]
    out: dict[str, float] = {
        "requests": len(timings),
        "failed": len(timings) - len(done),
        "wall_s": wall_s,
        "requests_per_s": len(done) / wall_s if wall_s else math.nan,
        "output_tokens_per_s": sum(t.num_tokens for t in done) / wall_s if wall_s else math.nan,
        "goodput_requests_per_s": sum(1 for t in done if slo.met_by(t)) / wall_s if wall_s else math.nan,
    }
    series = {
        "ttft": [t.ttft for t in done if t.ttft is not None],
        "itl": [x for t in done for x in t.itls],
        "e2e": [t.e2e for t in done if t.e2e is not None],
        "queue": [t.queue for t in done if t.queue is not None],
    }
    for name, values in series.items():
        for q in PERCENTILES:
            out[f"{name}_p{q}_s"] = percentile(values, q)  # type: ignore[arg-type]
    return out
