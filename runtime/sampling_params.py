"""SamplingParams: per-request generation parameters, validated with errors that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ifb.runtime.errors import AdmissionError
from ifb.runtime.guided import GuidedDecoding


def _check(condition: bool, name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise AdmissionError(f"{name} must be {allowed}, got {value!r}", field=name)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops. Defaults match OpenAI/vLLM."""

    max_tokens: int | None = None  # None: up to the runtime's default_max_tokens (see README)
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off (vLLM's -1 is accepted too)
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N alternatives per token (0 = only the sampled token)
    cache_salt: str | None = None
    guided: GuidedDecoding | None = None  # JSON schema / regex / grammar / choice constraint

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        m = self.max_tokens
        _check(m is None or (_is_int(m) and m >= 1), "max_tokens", "an integer >= 1", m)
        t = self.temperature
        _check(_is_number(t) and t >= 0, "temperature", "a finite number >= 0", t)
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (or -1 for off)", self.top_k)
        p = self.top_p
        _check(_is_number(p) and 0 < p <= 1, "top_p", "in (0, 1]", p)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        r = self.repetition_penalty
        _check(_is_number(r) and r > 0, "repetition_penalty", "a number > 0", r)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        for token, bias in self.logit_bias.items():
            _check(_is_int(token) and token >= 0, "logit_bias", "keyed by token ids >= 0", token)
            _check(_is_number(bias) and -100 <= bias <= 100, "logit_bias", "values in [-100, 100]", bias)
        _check(self.seed is None or _is_int(self.seed), "seed", "an integer", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(len(self.stop) <= 16, "stop", "at most 16 strings", len(self.stop))
        ids = self.stop_token_ids
        _check(all(_is_int(i) and i >= 0 for i in ids), "stop_token_ids", "token ids >= 0", ids)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        if m is not None:
            _check(self.min_tokens <= m, "min_tokens", f"<= max_tokens ({m})", self.min_tokens)
        lp = self.logprobs
        _check(lp is None or (_is_int(lp) and 0 <= lp <= 20), "logprobs", "an integer in [0, 20]", lp)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary."""
        for token in list(self.logit_bias) + list(self.stop_token_ids):
            _check(
                token < vocab_size,
                "logit_bias" if token in self.logit_bias else "stop_token_ids",
                f"token ids < vocab size {vocab_size}",
                token,
            )
