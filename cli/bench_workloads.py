"""Workloads for `ifb bench`: the seeds' scenario, Poisson arrivals, or the user's JSONL.

Every random draw comes from one seeded generator, so a workload is reproducible.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

SEED_OUTPUT_LENGTHS = (20, 25, 30, 40, 50, 60, 400, 600)
_WORDS = "time data model token batch cache block step query value key layer head graph engine queue seat".split()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    arrival_s: float  # offset from the start of the run
    prompt: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """`fixed:N`, `uniform:A-B` or `lognormal:MEDIAN,SIGMA` (chat-like heavy tail)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        kind, _, args = text.partition(":")
        try:
            if kind == "fixed":
                return cls(kind, float(args))
            if kind == "uniform":
                low, high = args.split("-")
                return cls(kind, float(low), float(high))
            if kind == "lognormal":
                median, sigma = args.split(",")
                return cls(kind, float(median), float(sigma))
        except ValueError:
            pass
        raise ValueError(f"length distribution {text!r}: use fixed:N, uniform:A-B or lognormal:MEDIAN,SIGMA")

    def draw(self, rng: random.Random, low: int = 1, high: int = 1 << 30) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        else:
            value = rng.lognormvariate(math.log(self.a), self.b)
        return max(low, min(high, round(value)))


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def seeds_workload(seed: int = 0, wave_gap_s: float = 2.0, prompt_words: int = 200) -> list[BenchRequest]:
    """Two waves of eight ~200-word prompts with forced output lengths 20 ... 600."""
    rng = random.Random(seed)
    return [
        BenchRequest(wave * wave_gap_s, _text(rng, prompt_words), length)
        for wave in range(2)
        for length in SEED_OUTPUT_LENGTHS
    ]


def poisson_workload(
    rate: float, num_requests: int, prompt_len: LengthDistribution, output_len: LengthDistribution, seed: int = 0
) -> list[BenchRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append(BenchRequest(t, _text(rng, prompt_len.draw(rng)), output_len.draw(rng)))
    return out


def dataset_workload(path: Path, rate: float | None = None, seed: int = 0) -> list[BenchRequest]:
    """One JSON object per line with `prompt` and `max_tokens`; all at once unless `rate`."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt, max_tokens = str(item["prompt"]), int(item["max_tokens"])
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: need prompt and max_tokens ({error})") from error
        if rate:
            t += rng.expovariate(rate)
        out.append(BenchRequest(t, prompt, max_tokens))
    return out
