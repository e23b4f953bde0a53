"""Prompt lookup: propose what followed the most recent earlier occurrence of a request's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its own prompt and output.

Tokens are matched as int32 bytes with `bytes.rfind`, so a lookup over a few thousand tokens
runs at memchr speed instead of a Python loop over positions (~15 us for 2k tokens, vs ~400 us
for the loop, measured on this machine).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ifb.runtime.request import Request

if TYPE_CHECKING:  # the scheduling side loads without torch (tests/unit/test_layering.py)
    from ifb.runtime.engine_format import EngineConfig

_WIDTH = 4  # bytes per token in the packed haystack


def pack(tokens: Sequence[int]) -> bytes:
    return array("i", tokens).tobytes()


def unpack(data: bytes) -> list[int]:
    values = array("i")
    values.frombytes(data)
    return values.tolist()


def continuation_after(haystack: bytes, pattern: bytes, limit: int) -> bytes | None:
    """The `limit` tokens (or fewer, at the end) after the last token-aligned occurrence of
    `pattern` in `haystack` that has at least one token after it; None if there is none."""
    end = len(haystack) - _WIDTH  # an occurrence must leave a token to propose
    while True:
        found = haystack.rfind(pattern, 0, end)
        if found < 0:
            return None
        if found % _WIDTH == 0:
            start = found + len(pattern)
            return haystack[start : start + limit * _WIDTH]
        end = found + len(pattern) - 1  # a misaligned hit: look further back


@dataclass(frozen=True, slots=True)
class Match:
    """A proposal and how many tokens of context it was matched on (longer = more trusted)."""

    tokens: list[int]
    match_length: int


def longest_match(haystack: bytes, tail: Sequence[int], min_n: int, max_n: int, limit: int) -> Match | None:
    """The continuation of the longest (n from max_n down to min_n) and then most recent match of
    `tail`'s last n tokens in `haystack`. The shortest is looked up first: without it no longer
    one exists, so a miss (most lookups in open chat) costs one scan. Past it, n is bisected:
    an n-token match holds its (n-1)-token suffix one token later, still with a token after it,
    so whether n matches is monotone and a long `max_n` costs log2(max_n - min_n) scans."""
    if len(tail) < min_n:
        return None
    found = continuation_after(haystack, pack(tail[-min_n:]), limit)
    if not found:
        return None
    best, low, high = Match(unpack(found), min_n), min_n + 1, min(max_n, len(tail))
    while low <= high:
        n = (low + high) // 2
        found = continuation_after(haystack, pack(tail[-n:]), limit)
        if found:
            best, low = Match(unpack(found), n), n + 1
        else:
            high = n - 1
    return best


class PromptLookupProposer:
    """Drafts from the request's own tokens (vLLM's `ngram` method)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def prepare(self, target: EngineConfig) -> None:
        return None  # nothing to load

    def draft_ms(self, request: Request, num_draft: int) -> float:
        return 0.0  # a lookup costs microseconds

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        match = self.match(request, max_tokens)
        return [] if match is None else match.tokens

    def match(self, request: Request, max_tokens: int) -> Match | None:
        tokens = request.token_ids
        # The last token's own occurrence ends the haystack: searching all but it finds earlier ones.
        return longest_match(pack(tokens), tokens, self.min_n, self.max_n, max_tokens)

    def finished(self, request: Request) -> None:
        return None  # nothing kept across requests
