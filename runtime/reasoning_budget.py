"""ReasoningBudget: at most N tokens inside a reply's `<think>` block; when they are spent, the
sampler forces the closing tag, token by token, and the model answers after it.

The request names the budget and where its reply starts (`starts_inside`: the chat template
opened the block, as a reasoning parser reads from the prompt's end); the frontend fills in the
tags' token ids as its tokenizer encodes them alone (`with_tags`). Which token is forced is a
function of the reply's tokens only (`forced_token`), so a row verifying speculative drafts,
which samples as if the drafts before it were already the reply's, needs no state to roll back.

Tags are matched as token sequences: exact where a tag is one token (Qwen3's and DeepSeek-R1's
vocabularies hold `<think>` and `</think>` as tokens); a tokenizer that spells a tag in pieces is
matched only in the pieces it encodes the tag into on its own.

    budget 3, starts inside:   a b c  -> forced "</think>" -> the answer, sampled as usual
    budget 3, reply opens it:  <think> a b c  -> forced "</think>" -> ...
    closed in time:            <think> a </think> ...  -> nothing forced
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ifb.runtime.errors import AdmissionError
from ifb.runtime.reasoning import partial_tag_length


@dataclass(frozen=True, slots=True)
class ReasoningBudget:
    max_tokens: int  # tokens the think block may hold before its close is forced (0: close at once)
    starts_inside: bool  # the prompt opened the block (the template wrote `<think>`)
    open_ids: tuple[int, ...] = ()  # the tags' tokens, filled in by the frontend
    close_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        tokens = self.max_tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise AdmissionError(
                f"max_reasoning_tokens must be an integer >= 0, got {tokens!r}", field="max_reasoning_tokens"
            )

    def with_tags(self, open_ids: Sequence[int], close_ids: Sequence[int]) -> ReasoningBudget:
        return replace(self, open_ids=tuple(open_ids), close_ids=tuple(close_ids))

    def forced_token(self, reply: Sequence[int]) -> int | None:
        """The token the reply so far (`reply`: its output tokens) must take next, or None."""
        start = self._reasoning_start(reply)
        if start is None or not self.close_ids:
            return None
        if len(reply) - start < self.max_tokens:
            return None
        reasoning = list(reply[start:])
        if _contains(reasoning, self.close_ids):
            return None  # closed by the model (or by earlier forcing): the answer is free
        return self.close_ids[partial_tag_length(reasoning, self.close_ids)]  # forcing under way

    def _reasoning_start(self, reply: Sequence[int]) -> int | None:
        """Where the block's tokens start in the reply; None outside one (or not yet known)."""
        if self.starts_inside:
            return 0
        opened = len(self.open_ids)
        if opened and tuple(reply[:opened]) == self.open_ids:
            return opened
        return None  # a reply opens a block with its first tokens or not at all (reasoning.py)


def _contains(tokens: list[int], tag: tuple[int, ...]) -> bool:
    """Whether `tag` occurs in `tokens` (list.index skips to each candidate in C)."""
    at = 0
    try:
        while True:
            at = tokens.index(tag[0], at)
            if tuple(tokens[at : at + len(tag)]) == tag:
                return True
            at += 1
    except ValueError:
        return False
