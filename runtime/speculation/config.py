"""SpeculativeConfig: which proposer drafts tokens and how far; vLLM's `--speculative-config`
JSON is read into the same object, so each knob is defined once."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from ifb.runtime.errors import LimitExceededError

# The planner sizes every draft by what it is expected to earn against what its rows cost, so this
# only bounds the lookup and the step's logits rows. Copies run long: on the edit workload of
# bench/speculative.py (SmolLM2 int8, one stream, AMX Xeon) 16 tokens matched on up to 16 kept
# 4.0-4.3 tokens a draft against 3.0 with 5 and 4 (1.85x over no drafts against 1.69x, same run);
# the longest match is bisected, so a long max_n costs a few scans more, not one per n.
DEFAULT_NUM_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP_MAX = 16
DEFAULT_PROMPT_LOOKUP_MIN = 2
# 64k tokens = 256 KiB of int32s: a lookup scans the whole cache at memchr-like speed
# (bytes.rfind), ~30 us for the lot, so a step with 32 requests spends about 1 ms on it.
DEFAULT_SUFFIX_CACHE_TOKENS = 65536


class SpeculativeMethod(str, Enum):
    OFF = "off"
    NGRAM = "ngram"  # prompt lookup in the request's own prompt and output
    SUFFIX = "suffix"  # the same, then recent requests' text (same cache_salt)
    DRAFT = "draft"  # a second compiled ifb engine with the same tokenizer, run greedily


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: SpeculativeMethod = SpeculativeMethod.OFF
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    suffix_cache_tokens: int = DEFAULT_SUFFIX_CACHE_TOKENS
    draft_engine: str | None = None  # the draft method's engine folder

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", SpeculativeMethod(self.method))
        if self.method is SpeculativeMethod.DRAFT and not self.draft_engine:
            raise LimitExceededError("speculative method draft needs draft_engine (--draft-engine DIR)")
        if self.draft_engine and self.method is not SpeculativeMethod.DRAFT:
            raise LimitExceededError(
                f"draft_engine {self.draft_engine!r} is only used by speculative method draft, not {self.method.value}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "suffix_cache_tokens"):
            if getattr(self, name) < 1:
                raise LimitExceededError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise LimitExceededError(
                f"prompt_lookup_max {self.prompt_lookup_max} must be >= prompt_lookup_min {self.prompt_lookup_min}"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not SpeculativeMethod.OFF


# The keys of vLLM's --speculative-config we take (its names are ours, but "model", the draft
# model, is our draft_engine folder); "method" takes vLLM's method names too ("ngram", "suffix",
# "draft_model"), and a "model" without a method means the draft method, as in vLLM.
_VLLM_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "suffix_cache_tokens",
)
_VLLM_METHODS = {"draft_model": SpeculativeMethod.DRAFT}


def parse_speculative_config(text: str, base: SpeculativeConfig) -> SpeculativeConfig:
    """vLLM's `--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, ...}'` over
    `base` (the separate flags); an unknown key or method is an error naming it."""
    try:
        record: Any = json.loads(text)
    except json.JSONDecodeError as error:
        raise LimitExceededError(f"speculative_config is not JSON: {error}") from None
    if not isinstance(record, dict):
        raise LimitExceededError("speculative_config must be a JSON object")
    unknown = sorted(set(record) - set(_VLLM_KEYS))
    if unknown:
        raise LimitExceededError(
            f"speculative_config: unsupported key(s) {', '.join(unknown)}; supported: {', '.join(_VLLM_KEYS)}"
        )
    default = SpeculativeMethod.DRAFT if "model" in record else SpeculativeMethod.NGRAM
    method = record.get("method", base.method.value if base.enabled else default.value)
    names = {m.value: m for m in SpeculativeMethod} | _VLLM_METHODS
    if not isinstance(method, str) or method not in names:  # a list is unhashable
        raise LimitExceededError(
            f"speculative_config: method {method!r} is not supported here; choose one of {', '.join(names)}"
        )
    values = {key: value for key, value in record.items() if key not in ("method", "model")}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise LimitExceededError(f"speculative_config: {key} must be an integer, got {value!r}")
    if "model" in record:
        if not isinstance(record["model"], str) or not record["model"]:
            raise LimitExceededError(f"speculative_config: model must be an engine folder, got {record['model']!r}")
        values["draft_engine"] = record["model"]
    return replace(base, method=names[method], **values)
