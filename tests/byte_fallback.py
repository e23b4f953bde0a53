"""A SentencePiece-style tokenizer with byte fallback, built with the `tokenizers` library as
Gemma's and Llama 2's tokenizer.json files are: a Unigram vocabulary of pieces plus the 256
`<0xNN>` byte tokens, spaces as `▁`, and the Replace / ByteFallback / Fuse decoders (Llama 2 adds
a Strip of the first leading space)."""

from __future__ import annotations

from typing import Any

from tiny_models import CHAT_TEMPLATE, SPECIAL

WORDS = (
    "the quick brown fox jumps over lazy dog in flight batching admits requests between steps "
    "paged attention stores keys and values blocks hello world"
).split()
# 3 special + 256 bytes + 61 pieces = 320, the tiny test models' vocabulary size
PIECES = [
    *SPECIAL,
    *(f"<0x{value:02X}>" for value in range(256)),
    "▁",
    *"abcdefghijklmnopqrstuvwxyz0123456789",
    *(f"▁{word}" for word in WORDS),
]


def byte_fallback_tokenizer(strip_leading_space: bool = False) -> Any:
    """Gemma's decoder shape; `strip_leading_space`: Llama 2's (a leading `▁` prepended to the
    text and stripped again when decoding)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    scores = [
        (piece, 0.0 if index < len(SPECIAL) + 256 else -float(len(PIECES) - index))
        for index, piece in enumerate(PIECES)
    ]
    tok = Tokenizer(models.Unigram(scores, unk_id=0, byte_fallback=True))
    spaces = [normalizers.Replace(" ", "▁")]
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:
        spaces.insert(0, normalizers.Prepend("▁"))
        steps.append(decoders.Strip(" ", 1, 0))
    tok.normalizer = normalizers.Sequence(spaces)
    tok.decoder = decoders.Sequence(steps)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def byte_token(value: int) -> int:
    """The id of the byte token `<0xNN>`."""
    return PIECES.index(f"<0x{value:02X}>")


def piece(text: str) -> int:
    return PIECES.index(text)
