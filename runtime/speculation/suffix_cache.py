"""Suffix cache: prompt lookup over recent requests too. Agent loops, templated answers and
retries repeat each other's text, which the request's own tokens do not hold yet.

Each finished request's tokens (prompt and output) are kept, packed as int32 bytes, in an LRU
per `cache_salt`, so a tenant never drafts from another's text (requests without a salt share
one). Bounded: at most `max_tokens` tokens over all tenants (4 bytes each), oldest dropped
first; a request longer than the bound keeps only its last `max_tokens`.
"""

from __future__ import annotations

from collections import OrderedDict

from ifb.runtime.request import Request
from ifb.runtime.speculation.prompt_lookup import Match, PromptLookupProposer, longest_match, pack

_WIDTH = 4


class SuffixCacheProposer:
    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.own = PromptLookupProposer(min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n
        self.max_tokens = max_tokens
        # (salt, request id) -> packed tokens, least recently added first
        self._entries: OrderedDict[tuple[str | None, str], bytes] = OrderedDict()
        self._num_tokens = 0

    @property
    def num_cached_tokens(self) -> int:
        return self._num_tokens

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """The longer of the request's own match and the cache's (own wins a tie: it is the
        request's own context)."""
        best = self.own.match(request, max_tokens)
        shared = self._match_cached(request, best.match_length + 1 if best else self.min_n, max_tokens)
        if shared is not None:
            best = shared
        return [] if best is None else best.tokens

    def _match_cached(self, request: Request, min_n: int, max_tokens: int) -> Match | None:
        if min_n > self.max_n:
            return None
        salt = request.params.cache_salt
        tail = request.token_ids[-self.max_n :]
        best: Match | None = None
        for (entry_salt, _), haystack in reversed(self._entries.items()):  # most recent first
            if entry_salt != salt:
                continue
            found = longest_match(
                haystack, tail, min_n if best is None else best.match_length + 1, self.max_n, max_tokens
            )
            if found is not None:
                best = found
                if best.match_length == self.max_n:
                    break
        return best

    def finished(self, request: Request) -> None:
        """Keep a finished request's text for the requests after it."""
        tokens = request.token_ids[-self.max_tokens :]
        if len(tokens) < self.min_n + 1:
            return
        key = (request.params.cache_salt, request.request_id)
        previous = self._entries.pop(key, None)
        if previous is not None:
            self._num_tokens -= len(previous) // _WIDTH
        self._entries[key] = pack(tokens)
        self._num_tokens += len(tokens)
        while self._num_tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self._num_tokens -= len(dropped) // _WIDTH
