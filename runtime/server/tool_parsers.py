"""Tool-call parsers: a chat reply's tool calls read out of the format its model family was taught.

Only `tool_choice: auto` needs one (a forced call is grammar-constrained JSON, tools.py reads it).
`--tool-call-parser` names one (vLLM's names); without it the chat template chooses
(`tool_call_parser_for_template`). `make_tool_call_parser` is the only code that branches on the
kind.

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the
  reply (Qwen2.5, Qwen3, SmolLM, Hermes).
- `llama3_json`: a reply that *is* the call, `{"name": ..., "parameters": {...}}` (or
  "arguments"), optionally after `<|python_tag|>`, several separated by `;` (Llama 3.1-3.3).
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (v3
  tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` once per call (v11 and later).

A block that does not parse or names a tool the request did not offer stays in the content, as
text. Each parser also says where a call can open (`CallMarkers`), so a stream holds back from
there on (`CallHoldBack`) and never shows part of a call as content:

    hermes  "Sure. " "<tool" "_call>{...}</tool_call>"   shown: "Sure. "   held: the rest
    llama3  " {" '"name": ...'                         shown: nothing    (a reply opening `{`)
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from ifb.runtime.reasoning import partial_tag_length

HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_OPEN = "[TOOL_CALLS]"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
# Llama 3.1-3.3's templates teach: Respond in the format {"name": function name, "parameters": ...}
_LLAMA3_INSTRUCTION = re.compile(r'\{"name":[^{}]{0,40},\s*"parameters"')
_SEPARATORS = " \t\r\n;"  # between llama3_json calls, and trimmed off the content left around them
# xgrammar lets raw control characters into strings, which strict JSON forbids; they come back
# escaped by the json.dumps that makes the arguments string.
JSON_DECODER = json.JSONDecoder(strict=False)
# Broken JSON in a reply stays text. Python's json raises RecursionError, not ValueError, on a
# block nested deeper than the interpreter's stack (100,000 '[' made every parser raise).


class ToolCallParserKind(str, enum.Enum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call read from a reply: a tool the request offered, its arguments as a JSON string."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class CallMarkers:
    """Where a family's call can open: at any of `anywhere` in the reply, or (`at_start`) only
    as the reply's first text, leading whitespace aside."""

    anywhere: tuple[str, ...] = ()
    at_start: tuple[str, ...] = ()
    # The markers are special tokens in the family's vocabularies, so a reply that may hold a call
    # is detokenized with special tokens (vLLM's Mistral parser does the same).
    special_tokens: bool = False


class ToolCallParser(Protocol):
    @property
    def markers(self) -> CallMarkers:
        """Where a stream must start holding back content: a call may follow."""
        ...

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished reply: calls naming one of `names`, and the text left
        around them (None when nothing is); with no call, `text` itself, unchanged."""
        ...


@dataclass(frozen=True, slots=True)
class HermesToolParser:
    @property
    def markers(self) -> CallMarkers:
        return CallMarkers(anywhere=(HERMES_OPEN,))

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        position = 0
        for match in _HERMES_BLOCK.finditer(text):
            call = _known_call(_loads(match.group(1)), names, "arguments")
            if call is not None:
                kept.append(text[position : match.start()])
                position = match.end()
                calls.append(call)
        kept.append(text[position:])
        return _reply(text, "".join(kept), calls)


@dataclass(frozen=True, slots=True)
class Llama3JsonToolParser:
    @property
    def markers(self) -> CallMarkers:
        # The whole reply is the call, so a reply opening otherwise is text and streams at once.
        return CallMarkers(at_start=("{", PYTHON_TAG), special_tokens=True)

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ParsedCall]]:
        body = text.lstrip()
        if not body.startswith(("{", PYTHON_TAG)):
            return text, []  # a JSON object after prose is prose: what a stream showed as content
        body = body.removeprefix(PYTHON_TAG)
        calls: list[ParsedCall] = []
        kept: list[str] = []
        position = _skip(body, 0)
        while position < len(body) and body[position] == "{":
            try:
                value, end = JSON_DECODER.raw_decode(body, position)
            except (ValueError, RecursionError):
                break  # broken JSON: it and what follows stay text
            call = _known_call(value, names, "parameters", "arguments")
            if call is None:
                kept.append(body[position:end])
            else:
                calls.append(call)
            position = _skip(body, end)
        kept.append(body[position:])
        return _reply(text, "; ".join(k.strip(_SEPARATORS) for k in kept if k.strip(_SEPARATORS)), calls)


@dataclass(frozen=True, slots=True)
class MistralToolParser:
    @property
    def markers(self) -> CallMarkers:
        # `[TOOL_CALLS]` is a special token in Mistral's tokenizers: a reply detokenized without
        # special tokens (a client's skip_special_tokens=true) brings a v3 call as the bare list.
        return CallMarkers(anywhere=(MISTRAL_OPEN,), at_start=("[",), special_tokens=True)

    def parse(self, text: str, names: Collection[str]) -> tuple[str | None, list[ParsedCall]]:
        head, marker, rest = text.partition(MISTRAL_OPEN)
        if not marker:
            if not text.lstrip().startswith("["):
                return text, []
            head, rest = "", text
        calls: list[ParsedCall] = []
        kept = [head]
        for segment in rest.split(MISTRAL_OPEN):  # v11+ repeats the marker per call
            found = _mistral_segment(segment, names)
            if found is None:
                kept.append(marker + segment)  # as it came
                continue
            calls += found[0]
            kept.append(found[1])
        return _reply(text, "".join(kept), calls)


def _mistral_segment(segment: str, names: Collection[str]) -> tuple[list[ParsedCall], str] | None:
    """The calls one `[TOOL_CALLS]` opens and the text after them; None if it opens none."""
    body = segment.lstrip()
    try:
        if body.startswith("["):  # v3: a JSON list of calls, all valid or the segment stays text
            value, end = JSON_DECODER.raw_decode(body)
            calls = [_known_call(item, names, "arguments") for item in value] if isinstance(value, list) else []
            valid = [c for c in calls if c is not None]
            return (valid, body[end:]) if valid and len(valid) == len(calls) else None
        brace = body.find("{")  # v11+: name[ARGS]{...}; a [CALL_ID]id before [ARGS] is skipped too
        if brace < 0:
            return None
        arguments, end = JSON_DECODER.raw_decode(body, brace)
    except (ValueError, RecursionError):
        return None
    call = _known_call({"name": body[:brace].split("[", 1)[0].strip(), "arguments": arguments}, names, "arguments")
    return ([call], body[end:]) if call is not None else None


def tool_call_parser_for_template(chat_template: str | None) -> ToolCallParserKind:
    """The format a chat template teaches its model to call tools in; hermes if it shows none."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return ToolCallParserKind.HERMES
    if MISTRAL_OPEN in template:
        return ToolCallParserKind.MISTRAL
    if PYTHON_TAG in template or _LLAMA3_INSTRUCTION.search(template):
        return ToolCallParserKind.LLAMA3_JSON
    return ToolCallParserKind.HERMES


def make_tool_call_parser(kind: ToolCallParserKind) -> ToolCallParser:
    """The parser `--tool-call-parser` names (or `tool_call_parser_for_template` chose)."""
    parsers: dict[ToolCallParserKind, type[HermesToolParser | Llama3JsonToolParser | MistralToolParser]] = {
        ToolCallParserKind.HERMES: HermesToolParser,
        ToolCallParserKind.LLAMA3_JSON: Llama3JsonToolParser,
        ToolCallParserKind.MISTRAL: MistralToolParser,
    }
    return parsers[ToolCallParserKind(kind)]()


@dataclass(slots=True)
class CallHoldBack:
    """One streamed reply's content, delta by delta: text that cannot be part of a call is shown
    at once; from where a call opens (or may still open) it is held for the parser at the end.
    `opened` from the start holds the whole reply (a forced call)."""

    markers: CallMarkers
    opened: bool = False
    held: str = ""
    past_start: bool = False  # the reply's first text was no `at_start` marker

    def feed(self, text: str) -> str:
        """The content that `text` (after what was held) makes safe to show."""
        pending, self.held = self.held + text, ""
        if not self.opened and not self.past_start and self.markers.at_start:
            head = pending.lstrip()
            if head.startswith(self.markers.at_start):
                self.opened = True
            elif any(marker.startswith(head) for marker in self.markers.at_start):
                self.held = pending  # only whitespace, or "<|py": may still open a call
                return ""
            self.past_start = True
        if self.opened:
            self.held = pending
            return ""
        found = [i for i in (pending.find(m) for m in self.markers.anywhere) if i >= 0]
        if found:
            self.opened, self.held = True, pending[min(found) :]
            return pending[: min(found)]
        keep = max((partial_tag_length(pending, m) for m in self.markers.anywhere), default=0)
        self.held = pending[len(pending) - keep :]
        return pending[: len(pending) - keep]

    def finish(self) -> str:
        """What was held back, once the reply has ended: for the parser (calls, or text after all)."""
        held, self.held = self.held, ""
        return held


def _known_call(value: Any, names: Collection[str], *argument_keys: str) -> ParsedCall | None:
    """`value` as a call if it is {"name": a tool offered, <an argument key>: ...}, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments: Any = next((value[k] for k in argument_keys if k in value), {})
    if not isinstance(arguments, str):
        return ParsedCall(value["name"], json.dumps(arguments))  # ASCII: escapes any lone surrogate
    try:
        arguments.encode("utf-8")
    except UnicodeEncodeError:
        # A string the model escaped as "\ud800" decodes to a lone surrogate, which no UTF-8 reply
        # can carry: such a reply stays text rather than failing the response.
        return None
    return ParsedCall(value["name"], arguments)


def _loads(text: str) -> Any:
    try:
        return JSON_DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def _reply(text: str, content: str, calls: list[ParsedCall]) -> tuple[str | None, list[ParsedCall]]:
    """The parser's answer: the text left once calls were found (None if nothing is), else `text`."""
    return ((content.strip() or None) if calls else text), calls


def _skip(text: str, position: int) -> int:
    while position < len(text) and text[position] in _SEPARATORS:
        position += 1
    return position
