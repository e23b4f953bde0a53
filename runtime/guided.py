"""Guided decoding: JSON schema, any JSON, regex, EBNF grammar or a choice, with xgrammar.

A constraint is compiled in a worker process (guided_pool.py) and each guided request gets its
own matcher; in the step loop a guided row gets its token bitmask, an unguided row pays nothing.
Compile errors, compiles past their budget and strings that are not Unicode (a lone surrogate)
are AdmissionErrors that name the request field, raised before the request takes a seat.

xgrammar matches UTF-8 at the byte level and treats U+D800..U+DFFF as characters: a negated class
(a JSON string's `[^"\\\r\n]`) accepts their 3-byte encodings ED A0..BF xx, which are not UTF-8
(RFC 3629) and decode to three U+FFFD each, so a string at its maxLength decodes two characters
longer per surrogate (issue #23). Every other malformed sequence it already refuses (the tests
probe each lead and second byte), so a guided request's matcher refuses exactly these bytes too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ifb.runtime.errors import AdmissionError
from ifb.runtime.unicode_text import require_unicode_strings


class GuideKind(str, Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    GRAMMAR = "grammar"
    CHOICE = "choice"


@dataclass(frozen=True, slots=True)
class GuidedDecoding:
    """One constraint. `spec` is text (schema JSON, regex, EBNF, or a JSON list of choices);
    `field` is the request field it came from, for error messages."""

    kind: GuideKind
    spec: str = ""
    field: str = "guided"

    def __post_init__(self) -> None:
        # Here, where every constraint is made (HTTP, Ray, Python callers), not per route.
        require_unicode_strings(_spec_strings(self.kind, self.spec), self.field)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, field: str = "guided_json") -> GuidedDecoding:
        return cls(GuideKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema), field)

    @classmethod
    def json_object(cls, field: str = "response_format") -> GuidedDecoding:
        return cls(GuideKind.JSON_OBJECT, "", field)

    @classmethod
    def regex(cls, pattern: str, field: str = "guided_regex") -> GuidedDecoding:
        return cls(GuideKind.REGEX, pattern, field)

    @classmethod
    def grammar(cls, ebnf: str, field: str = "guided_grammar") -> GuidedDecoding:
        return cls(GuideKind.GRAMMAR, ebnf, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "guided_choice") -> GuidedDecoding:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise AdmissionError(f"{field} must be a non-empty list of non-empty strings", field=field)
        return cls(GuideKind.CHOICE, json.dumps(choices), field)


def _spec_strings(kind: GuideKind, spec: str) -> Any:
    """The strings a constraint hands the grammar engine: a schema's or a choice list's as JSON
    decodes them (a schema text may escape a surrogate as \\ud800), else the text itself."""
    if kind in (GuideKind.JSON_SCHEMA, GuideKind.CHOICE):
        try:
            return json.loads(spec)
        except (ValueError, RecursionError):
            return spec  # not JSON (or nested past the parser): the compiler names that error
    return spec


def _choice_grammar(spec: str) -> str:
    # ensure_ascii=False: an ASCII literal spells a character past U+FFFF as a surrogate pair
    # (\ud800\udc00), which xgrammar's EBNF reads as two code points and matches as their 3-byte
    # would-be encodings (CESU-8, not UTF-8), which the surrogate guard then refuses.
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec))
    return f"root ::= {alternatives}"


SURROGATE_LEAD = 0xED  # ED A0..BF xx is how U+D800..U+DFFF would be encoded; ED 80..9F xx is valid
SURROGATE_SECOND = range(0xA0, 0xC0)
_ENCODED_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


@dataclass(frozen=True, slots=True)
class SurrogateGuard:
    """The tokens whose bytes would put an encoded surrogate in a guided output: those holding
    one whole (`anywhere`), and those starting with A0..BF after an output ending in byte ED
    (`after_lead`). Masks are xgrammar bitmask rows (a clear bit bans the token), None when the
    vocabulary has no such token."""

    ends_in_lead: frozenset[int]
    empty: frozenset[int]  # special tokens and padding: they leave the output's last byte as it was
    anywhere: frozenset[int]
    after_lead: frozenset[int]
    anywhere_mask: Any
    after_lead_mask: Any

    @classmethod
    def from_vocab(cls, decoded_vocab: list[bytes], vocab_size: int) -> SurrogateGuard:
        ends_in_lead: set[int] = set()
        empty = set(range(len(decoded_vocab), vocab_size))
        anywhere: set[int] = set()
        after_lead: set[int] = set()
        for token, data in enumerate(decoded_vocab[:vocab_size]):
            if not data:
                empty.add(token)
                continue
            if data[-1] == SURROGATE_LEAD:
                ends_in_lead.add(token)
            if _ENCODED_SURROGATE.search(data):
                anywhere.add(token)
                after_lead.add(token)
            elif data[0] in SURROGATE_SECOND:
                after_lead.add(token)
        return cls(
            frozenset(ends_in_lead),
            frozenset(empty),
            frozenset(anywhere),
            frozenset(after_lead),
            _ban_mask(anywhere, vocab_size),
            _ban_mask(after_lead, vocab_size),
        )

    def allows(self, token: int, after_lead: bool) -> bool:
        return token not in (self.after_lead if after_lead else self.anywhere)

    def leaves_lead(self, token: int, after_lead: bool) -> bool:
        """Whether the output ends in byte ED once `token` is appended to it."""
        return token in self.ends_in_lead or (after_lead and token in self.empty)

    def restrict(self, row: Any, after_lead: bool) -> None:
        """Clear the banned tokens' bits in one xgrammar bitmask row, in place."""
        mask = self.after_lead_mask if after_lead else self.anywhere_mask
        if mask is not None:
            row &= mask


def _ban_mask(tokens: set[int], vocab_size: int) -> Any:
    """An xgrammar bitmask row (int32 words, bit i of word w for token 32w+i) with `tokens` clear."""
    if not tokens:
        return None
    import numpy as np
    import torch

    allowed = np.ones((vocab_size + 31) // 32 * 32, dtype=bool)
    allowed[np.fromiter(tokens, dtype=np.int64, count=len(tokens))] = False
    words = np.packbits(allowed, bitorder="little").view("<i4").astype(np.int32)
    return torch.from_numpy(words)


class GuidedMatcher:
    """A guided request's xgrammar GrammarMatcher that also refuses encoded surrogates (see the
    module docstring): its masks never offer such a token and `accept_token` refuses one, so the
    output is UTF-8 and a string's length in the grammar is its length once decoded."""

    def __init__(self, compiled: Any, guard: SurrogateGuard) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._guard = guard
        self._after_lead = [False]  # per accepted token (and the start): output ends in byte ED

    def accept_token(self, token: int) -> bool:
        after_lead = self._after_lead[-1]
        if not self._guard.allows(token, after_lead) or not self._matcher.accept_token(token):
            return False
        self._after_lead.append(self._guard.leaves_lead(token, after_lead))
        return True

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        del self._after_lead[len(self._after_lead) - num_tokens :]

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)
        self._guard.restrict(bitmask[index], self._after_lead[-1])


@dataclass(frozen=True, slots=True)
class CompiledGuide:
    """A compiled constraint and the vocabulary's surrogate guard: what a guided request's
    matcher is made from."""

    grammar: Any  # xgrammar CompiledGrammar
    guard: SurrogateGuard

    def matcher(self) -> GuidedMatcher:
        return GuidedMatcher(self.grammar, self.guard)


def compile_constraint(compiler: Any, kind: GuideKind, spec: str) -> Any:
    """`spec` compiled by an xgrammar GrammarCompiler (in a compile worker: guided_pool.py)."""
    if kind is GuideKind.JSON_SCHEMA:
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind is GuideKind.JSON_OBJECT:
        return compiler.compile_builtin_json_grammar()
    if kind is GuideKind.REGEX:
        return compiler.compile_regex(spec)
    if kind is GuideKind.CHOICE:
        return compiler.compile_grammar(_choice_grammar(spec))
    return compiler.compile_grammar(spec)


@dataclass(frozen=True, slots=True)
class GuidedRow:
    """A guided sampling row: its index in the step's rows, its request's matcher, and the draft
    tokens before its position (speculation) the mask must assume were accepted."""

    row: int
    matcher: Any
    pending: tuple[int, ...] = ()


def fill_bitmask(rows: list[GuidedRow], num_rows: int, vocab_size: int) -> Any:
    """One int32 bitmask for the step's sampling rows; only guided rows are filled. A row after
    draft tokens is filled with its matcher advanced over them, then rolled back."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    for guided in rows:
        for token in guided.pending:  # drafts were cut to what the grammar accepts (verification.py)
            guided.matcher.accept_token(token)
        guided.matcher.fill_next_token_bitmask(bitmask, guided.row)
        if guided.pending:
            guided.matcher.rollback(len(guided.pending))
    return bitmask


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
