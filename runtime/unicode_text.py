"""Lone surrogates in caller-given text: refused with an AdmissionError naming the field.

JSON can carry a lone surrogate ("\\ud800") that is a valid Python str but no UTF-8 text: no
tokenizer can encode it, and a grammar built from it (a choice, a schema's enum) accepted the
request and generated. Prompts, chat messages, every string that reaches a grammar and the tools
a chat template shows are checked here, so each answers the same 400.
"""

from __future__ import annotations

from typing import Any

from ifb.runtime.errors import AdmissionError


def require_unicode(text: str, field: str) -> None:
    """`text` must be encodable as UTF-8; else an AdmissionError naming `field`."""
    position = _bad_position(text)
    if position is not None:
        raise AdmissionError(f"{field} is not valid Unicode at character {position}", field=field)


def require_unicode_strings(value: Any, field: str, path: str | None = None) -> None:
    """Every string in the JSON value `value` (object keys too, at any depth) must be UTF-8
    text; else an AdmissionError naming `field`, its message the place inside (`path`, default
    `field`, then keys and list indices: `guided_json.properties.name.enum.2`)."""
    found = _first_bad(value, path or field)
    if found is not None:
        raise AdmissionError(found, field=field)


def _first_bad(value: Any, path: str) -> str | None:
    """The message for the first bad string, or None. A loop over a stack, not recursion: a
    schema nested thousands deep is refused by the compiler, not by a RecursionError here."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            position = _bad_position(item)
            if position is not None:
                return f"{where} is not valid Unicode at character {position}"
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                position = _bad_position(key) if isinstance(key, str) else None
                if position is not None:  # the key itself cannot go in the message: it is not text
                    return f"{where} has a key that is not valid Unicode at character {position}"
                stack.append((child, f"{where}.{key}"))
        elif isinstance(item, list | tuple):
            stack.extend((child, f"{where}.{index}") for index, child in reversed(list(enumerate(item))))
    return None


def _bad_position(text: str) -> int | None:
    if text.isascii():  # the common case, without building the encoded copy
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None
