"""SamplingState: a request's torch and xgrammar objects, owned by the executor beside the
torch-free Request (the scheduling side never imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ifb.runtime.guided import CompiledGuide, GuidedMatcher
from ifb.runtime.request import Request


@dataclass(slots=True)
class SamplingState:
    generator: torch.Generator | None = None  # seeded requests draw their noise from their own
    grammar_matcher: GuidedMatcher | None = None  # a guided request's

    @classmethod
    def create(cls, seed: int | None, compiled_grammar: CompiledGuide | None) -> SamplingState:
        matcher = compiled_grammar.matcher() if compiled_grammar is not None else None
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return cls(generator, matcher)


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One sampling row of a step: the request and its sampling state. A row verifying a
    speculative draft samples as if the draft tokens before its position (`pending`) were
    already the request's: penalties and min_tokens see them."""

    request: Request
    state: SamplingState
    pending: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return [*self.request.token_ids, *self.pending]

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.request.output_token_ids, *self.pending]

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.pending)
