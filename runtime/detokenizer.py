"""IncrementalDetokenizer: streams text token by token and finds stop strings across tokens.

Text that could still become a stop string is held back until it cannot, so a stop string is
never emitted, even when it spans several tokens.

Fast tokenizers decode with the tokenizers library's own `DecodeStream` (one call into Rust per
token); slow (pure Python) tokenizers re-decode a short tail through `tokenizer.decode`.
Both start from the last prompt tokens, so the first output token gets its leading space right.

DecodeStream assumes the text of the tokens it has seen never changes as tokens follow. With a
byte-fallback vocabulary (SentencePiece: Gemma, Llama 2, Mistral) it can: the decoder turns a run
of byte tokens that is not valid UTF-8 into one U+FFFD per byte, so an ASCII byte token
streamed as "x" becomes "\ufffd" once an invalid byte follows it, and DecodeStream raises
("Invalid prefix encountered", vLLM issue 17448). The text already sent stays; the stream
restarts from the tokens not yet shown, so the user gets "x\ufffdj" for the bytes 78 E2 6A
(Python's own lossy UTF-8 decode), and the request goes on.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the output so leading spaces come out right
_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error when earlier text changed


class _StreamDecoder(Protocol):
    def step(self, token_ids: list[int]) -> str:
        """The text the new tokens complete ("" while a multi-token character is unfinished)."""
        ...


class _RustStreamDecoder:
    """tokenizers' DecodeStream: buffers bytes of an unfinished character inside the library.

    `_unshown` are the tokens pushed since the stream last returned text: where it restarts
    when the text of earlier tokens changed under it (the module docstring)."""

    def __init__(self, tokenizer: Any, context_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = skip_special_tokens
        # A context whose text ends in an unfinished character gives DecodeStream no prefix, and
        # its first output would repeat the context's text: such a tail is left out.
        context = list(context_token_ids)
        while context and self._backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()
        self._stream = DecodeStream(context, skip_special_tokens=skip_special_tokens)
        self._unshown: list[int] = []

    def step(self, token_ids: list[int]) -> str:
        self._unshown += token_ids
        try:
            text = self._stream.step(self._backend, token_ids)
        except Exception as error:  # tokenizers raises a bare Exception
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            logger.warning("detokenizer: %s; restarting the stream from %d tokens", error, len(self._unshown))
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            text = self._stream.step(self._backend, self._unshown)  # no prefix yet: this cannot raise it
        if text:
            self._unshown = []
        return text or ""


class _TailDecoder:
    """Decodes [prefix_offset:] and [prefix_offset:read_offset] with `tokenizer.decode`; the new
    text is the difference, unless it ends in an unfinished UTF-8 sequence."""

    def __init__(self, tokenizer: Any, context_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(context_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        before = self._decode(self._ids[self._prefix_offset : self._read_offset])
        after = self._decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return after[len(before) :]


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], stop: tuple[str, ...], skip_special_tokens: bool = True
    ) -> None:
        # DecodeStream runs only the Rust decoder: a tokenizer whose decode() also cleans up spaces
        # in Python would stream different text than it decodes, so it keeps the tail path.
        rust = hasattr(tokenizer, "backend_tokenizer") and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        decoder = _RustStreamDecoder if rust else _TailDecoder
        self._decoder: _StreamDecoder = decoder(
            tokenizer, list(prompt_token_ids[-_PROMPT_CONTEXT:]), skip_special_tokens
        )
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_ids: list[int]) -> None:
        """Add tokens; sets `stopped` (and cuts `text`) when a stop string appears."""
        new_text = self._decoder.step(token_ids)
        if not new_text:
            return
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += new_text
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
