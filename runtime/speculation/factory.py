"""make_speculation: the one place the speculative method is branched on."""

from __future__ import annotations

from ifb.runtime.speculation.config import SpeculativeConfig, SpeculativeMethod
from ifb.runtime.speculation.draft_model import DraftModelProposer
from ifb.runtime.speculation.planner import NoSpeculation, Proposer, Speculation, SpeculationPlanner
from ifb.runtime.speculation.prompt_lookup import PromptLookupProposer
from ifb.runtime.speculation.suffix_cache import SuffixCacheProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method is SpeculativeMethod.NGRAM:
        return PromptLookupProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method is SpeculativeMethod.SUFFIX:
        return SuffixCacheProposer(config.prompt_lookup_min, config.prompt_lookup_max, config.suffix_cache_tokens)
    if config.method is SpeculativeMethod.DRAFT and config.draft_engine is not None:
        return DraftModelProposer(config.draft_engine)
    raise ValueError(f"no proposer for {config.method.value}")


def make_speculation(config: SpeculativeConfig) -> Speculation:
    if not config.enabled:
        return NoSpeculation()
    return SpeculationPlanner(make_proposer(config), config.num_speculative_tokens)
