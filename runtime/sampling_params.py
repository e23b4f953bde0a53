"""SamplingParams: per-request generation parameters, validated with errors that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ifb.runtime.errors import AdmissionError
from ifb.runtime.guided import GuidedDecoding
from ifb.runtime.reasoning_budget import ReasoningBudget

# Documented bounds of every field (README "Request limits"): past them a request is a 400.
MAX_TOP_K = 1 << 20  # and never above the vocabulary (check_vocab)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # a torch.Generator seed is a signed 64-bit integer
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 16, 256
MAX_STOP_TOKEN_IDS = 256  # the sampler masks these every step while min_tokens holds
MAX_LOGIT_BIAS = 1024
MAX_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256


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
    skip_special_tokens: bool = True  # False: special tokens' text is in the reply (not a finishing EOS / stop id)
    reasoning_budget: ReasoningBudget | None = None  # tokens a <think> block may hold (reasoning_budget.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
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
        k = self.top_k
        _check(_is_int(k) and 0 <= k <= MAX_TOP_K, "top_k", f"an integer in [0, {MAX_TOP_K}] (or -1 for off)", k)
        p = self.top_p
        _check(_is_number(p) and 0 < p <= 1, "top_p", "in (0, 1]", p)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        r = self.repetition_penalty
        _check(_is_number(r) and r > 0, "repetition_penalty", "a number > 0", r)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        num_biases = len(self.logit_bias)
        _check(num_biases <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries", num_biases)
        for token, bias in self.logit_bias.items():
            _check(_is_int(token) and token >= 0, "logit_bias", "keyed by token ids >= 0", token)
            _check(_is_number(bias) and -100 <= bias <= 100, "logit_bias", "values in [-100, 100]", bias)
        s = self.seed
        _check(s is None or (_is_int(s) and SEED_MIN <= s <= SEED_MAX), "seed", "a signed 64-bit integer", s)
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings", len(self.stop))
        stop_ok = all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)
        _check(stop_ok, "stop", f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters", self.stop)
        ids = self.stop_token_ids
        _check(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids", len(ids))
        _check(all(_is_int(i) and i >= 0 for i in ids), "stop_token_ids", "token ids >= 0", ids)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        if m is not None:
            _check(self.min_tokens <= m, "min_tokens", f"<= max_tokens ({m})", self.min_tokens)
        lp = self.logprobs
        lp_ok = lp is None or (_is_int(lp) and 0 <= lp <= MAX_LOGPROBS)
        _check(lp_ok, "logprobs", f"an integer in [0, {MAX_LOGPROBS}]", lp)
        salt = self.cache_salt
        salt_ok = salt is None or (isinstance(salt, str) and len(salt) <= MAX_CACHE_SALT_CHARS)
        _check(salt_ok, "cache_salt", f"a string of at most {MAX_CACHE_SALT_CHARS} characters", salt)
        skip = self.skip_special_tokens
        _check(isinstance(skip, bool), "skip_special_tokens", "true or false", skip)
        if self.reasoning_budget is not None:
            self.reasoning_budget.validate()

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary, and top_k cannot exceed it."""
        _check(self.top_k <= vocab_size, "top_k", f"<= the vocabulary size {vocab_size}", self.top_k)
        for token in list(self.logit_bias) + list(self.stop_token_ids):
            name = "logit_bias" if token in self.logit_bias else "stop_token_ids"
            _check(token < vocab_size, name, f"token ids < vocab size {vocab_size}", token)
