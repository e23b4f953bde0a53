"""Reasoning parsers: a chat reply's `<think>…</think>` part split off as reasoning, the rest content.

`--reasoning-parser` names one (vLLM's names); `make_reasoning_parser` is the only code that
branches on the kind. Both parsers run the same small state machine, `ReasoningStream`, and
differ only in where a reply starts:

- `deepseek_r1`: inside a think block (the template opens the tag), so everything before the
  first `</think>` is reasoning; with no `</think>` the whole reply is.
- `qwen3`: inside only when the reply opens with `<think>` or the prompt ends with an open one
  (a template that writes the tag itself); otherwise the reply is all content. Reading the
  prompt, not guessing from the reply, is what lets a stream send reasoning before `</think>`.
- no parser: outside, with no way in: the reply is content as generated.

A grammar-constrained reply starts outside (the grammar, not the template, decides whether it
opens a think block): a forced tool call or a JSON answer is content, never reasoning.

Streamed, a tag may be split across deltas: text that could still be the start of the tag
being looked for is held back until the next delta resolves it, so reasoning and content are
each exactly what splitting the whole reply gives (`split_reasoning`).

    "<think>" "plan" "</th" "ink>" "answer"
    reasoning:       "plan"                  content: "answer"   (held: "</th" for one delta)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
PROMPT_TAIL_TOKENS = 16  # how much of the prompt's end `qwen3` reads to see an open <think>
T = TypeVar("T")


class ReasoningParserKind(str, enum.Enum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    """A reply (or the part of one a delta made safe to send) as reasoning and content."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningSplit) -> ReasoningSplit:
        return ReasoningSplit(self.reasoning + other.reasoning, self.content + other.content)


class _State(enum.Enum):
    START = "start"  # nothing decided yet: a leading <think> may still come
    REASONING = "reasoning"  # inside the think block, until </think>
    CONTENT = "content"  # after it, or a reply without one: everything else


@dataclass(slots=True)
class ReasoningStream:
    """One reply's split, fed delta by delta. `inside`: where the reply starts when it does not
    open with `<think>` itself (inside a block the prompt opened, or outside)."""

    state: _State
    inside: bool = False
    held: str = ""

    def feed(self, text: str) -> ReasoningSplit:
        """The reasoning and content that `text` (after what was held) makes safe to send."""
        pending, self.held = self.held + text, ""
        if self.state is _State.START:
            if THINK_OPEN.startswith(pending) and pending != THINK_OPEN:
                self.held = pending  # "", "<", "<th": may still open a block
                return ReasoningSplit()
            opens = pending.startswith(THINK_OPEN)
            pending = pending.removeprefix(THINK_OPEN)
            self.state = _State.REASONING if opens or self.inside else _State.CONTENT
        if self.state is _State.CONTENT:
            return ReasoningSplit(content=pending)
        reasoning, closed, content = pending.partition(THINK_CLOSE)
        if closed:
            self.state = _State.CONTENT
            return ReasoningSplit(reasoning, content)
        keep = partial_tag_length(pending, THINK_CLOSE)
        self.held = pending[len(pending) - keep :]
        return ReasoningSplit(reasoning=pending[: len(pending) - keep])

    def finish(self) -> ReasoningSplit:
        """What was held back, once the reply has ended: a tag's prefix that never completed."""
        held, self.held = self.held, ""
        if self.state is _State.CONTENT or (self.state is _State.START and not self.inside):
            return ReasoningSplit(content=held)
        return ReasoningSplit(reasoning=held)


def split_reasoning(stream: ReasoningStream, text: str) -> ReasoningSplit:
    """A whole reply at once: the same split a stream makes of it delta by delta."""
    return stream.feed(text) + stream.finish()


class ReasoningParser(Protocol):
    @property
    def reads_prompt(self) -> bool:
        """Whether `stream` needs the prompt's end (the caller detokenizes it only then)."""
        ...

    def stream(self, prompt_tail: str, guided: bool) -> ReasoningStream:
        """A fresh split for one reply to a prompt ending in `prompt_tail`; `guided`: the reply
        is grammar-constrained, so it starts outside any think block."""
        ...

    def starts_inside(self, prompt_tail: str, guided: bool) -> bool | None:
        """Whether such a reply starts inside a think block; None: this parser reads no blocks."""
        ...


@dataclass(frozen=True, slots=True)
class NoReasoning:
    """No parser: the reply is content, as generated."""

    @property
    def reads_prompt(self) -> bool:
        return False

    def stream(self, prompt_tail: str, guided: bool) -> ReasoningStream:
        return ReasoningStream(_State.CONTENT)

    def starts_inside(self, prompt_tail: str, guided: bool) -> bool | None:
        return None


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """`<think>…</think>` reasoning; `template_opens`: the chat template always opens the block
    (deepseek_r1), else only a prompt that ends with an open `<think>` does (qwen3)."""

    template_opens: bool

    @property
    def reads_prompt(self) -> bool:
        return not self.template_opens

    def stream(self, prompt_tail: str, guided: bool) -> ReasoningStream:
        return ReasoningStream(_State.START, inside=self.starts_inside(prompt_tail, guided))

    def starts_inside(self, prompt_tail: str, guided: bool) -> bool:
        return not guided and (self.template_opens or prompt_tail.rstrip().endswith(THINK_OPEN))


def make_reasoning_parser(kind: ReasoningParserKind | None) -> ReasoningParser:
    """The parser `--reasoning-parser` names; None (the default) leaves replies as they are."""
    if kind is None:
        return NoReasoning()
    kind = ReasoningParserKind(kind)
    if kind is ReasoningParserKind.QWEN3:
        return ThinkTags(template_opens=False)
    if kind is ReasoningParserKind.DEEPSEEK_R1:
        return ThinkTags(template_opens=True)
    raise AssertionError(kind)


def partial_tag_length(text: Sequence[T], tag: Sequence[T]) -> int:
    """How many trailing items of `text` (characters, or token ids) could be the start of `tag`:
    what a stream holds back, or how much of a closing tag a reply already ends with."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tuple(text[-size:]) == tuple(tag[:size]):
            return size
    return 0
