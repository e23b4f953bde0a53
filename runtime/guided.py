"""Guided decoding: JSON schema, any JSON, regex, EBNF grammar or a choice, with xgrammar.

A constraint is compiled once per distinct text (xgrammar's compiler cache, bounded in bytes) and
each guided request gets its own matcher; in the step loop a guided row gets its token bitmask,
an unguided row pays nothing. Compile errors and compile timeouts are AdmissionErrors that name
the request field, raised before the request takes a seat.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ifb.runtime.errors import AdmissionError

COMPILE_TIMEOUT_S = 10.0
CACHE_LIMIT_BYTES = 256 << 20


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


def _choice_grammar(spec: str) -> str:
    alternatives = " | ".join(json.dumps(choice) for choice in json.loads(spec))
    return f"root ::= {alternatives}"


class GrammarCompiler:
    """Thread-safe front of xgrammar's compiler, with a compile-time bound and statistics."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ifb-grammar")
        self.vocab_size = vocab_size

    def _compile(self, guide: GuidedDecoding) -> Any:
        c = self._compiler
        if guide.kind is GuideKind.JSON_SCHEMA:
            return c.compile_json_schema(guide.spec, any_whitespace=False)
        if guide.kind is GuideKind.JSON_OBJECT:
            return c.compile_builtin_json_grammar()
        if guide.kind is GuideKind.REGEX:
            return c.compile_regex(guide.spec)
        if guide.kind is GuideKind.CHOICE:
            return c.compile_grammar(_choice_grammar(guide.spec))
        return c.compile_grammar(guide.spec)

    def compile(self, guide: GuidedDecoding, timeout_s: float = COMPILE_TIMEOUT_S) -> tuple[Any, float]:
        """(xgrammar CompiledGrammar, seconds it took); AdmissionError naming the field on any
        failure. Cached per distinct constraint by xgrammar; matchers are made by the executor."""
        start = time.perf_counter()
        future = self._pool.submit(self._compile, guide)
        try:
            compiled = future.result(timeout=timeout_s)
        except FutureTimeout:
            raise AdmissionError(
                f"{guide.field}: the constraint did not compile within {timeout_s:.0f}s", field=guide.field
            ) from None
        except Exception as error:  # xgrammar reports parse errors as RuntimeError/ValueError
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise AdmissionError(f"{guide.field}: invalid {guide.kind.value}: {message}", field=guide.field) from None
        return compiled, time.perf_counter() - start


def fill_bitmask(matchers: list[tuple[int, Any]], num_rows: int, vocab_size: int) -> Any:
    """One int32 bitmask for the step's sampling rows; only guided rows are filled."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
    for row, matcher in matchers:
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
