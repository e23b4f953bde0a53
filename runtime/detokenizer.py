"""IncrementalDetokenizer: streams text token by token and finds stop strings across tokens.

Text that could still become a stop string is held back until it cannot, so a stop string is
never emitted, even when it spans several tokens.
"""

from __future__ import annotations

from typing import Any

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> None:
        """Add tokens; sets `stopped` (and cuts `text`) when a stop string appears."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        found = [i for i in (self.text.find(stop, searched_from) for stop in self.stop) if i != -1]
        if found:  # the earliest stop string wins, whatever order they were given in
            self.text = self.text[: min(found)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """The text safe to show now (everything, once the request is final)."""
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
