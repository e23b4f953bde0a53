"""A GGUF's tokenizer built from its own `tokenizer.ggml.*` vocabulary with `tokenizers`, in seconds.

transformers' GGUF conversion reads the same fields through a per-element reader and derives
SentencePiece merges in Python: 116 s for Gemma 3's 262k vocabulary. Here the header is read by
`gguf_fields`, the merges derived by `bpe_merges`, and `tokenizers` is handed the vocabulary and
merges once. The result is the tokenizer transformers' conversion makes
(`transformers.integrations.gguf.gguf_tokenizer_mapping`): the same model, normalizer, pre-tokenizer,
decoder, added tokens, special tokens, add-BOS/EOS flags and chat template, so the engine folder's
`tokenizer/` and every id it gives are unchanged. One deliberate difference: transformers' conversion
appends its tokenizer classes' default special tokens that the file lacks (`<|endoftext|>` after a
Llama 3 vocabulary), ids past the model's vocabulary; those are left out.

A vocabulary kind or pre-tokenizer this module does not know is handed to transformers (one log line).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ifb.builder.bpe_merges import derived_merges
from ifb.builder.errors import SourceError
from ifb.builder.families import VocabularyStyle, vocabulary_style
from ifb.builder.gguf_fields import read_gguf_fields

logger = logging.getLogger(__name__)

# token types llama.cpp writes in tokenizer.ggml.token_type
_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space

# The split regexes of the byte-level pre-tokenizers, by `tokenizer.ggml.pre` (llama.cpp's
# `llama-vocab.cpp` names; the regexes are the ones those models' tokenizer.json use).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O),
}
# Byte-level pre-tokenizers that are GPT-2's own regex (ByteLevel with use_regex). "default" is what a
# converter writes when it does not recognize the tokenizer; "smollm" also splits digits singly in
# llama.cpp, which changes no id of SmolLM/SmolLM2 (none of their merges holds a digit) and is what
# transformers' conversion does too.
GPT2_PRE_TOKENIZERS = ("default", "gpt-2", "gpt2", "smollm")
# the default special tokens of the tokenizer class transformers builds each kind with; added as special
# tokens where the vocabulary has them, as that class's constructor does
_CLASS_SPECIALS = {
    "gpt2": ("<|endoftext|>",),
    "llama": ("<unk>", "<s>", "</s>"),
    "gemma": ("<unk>", "<bos>", "<eos>", "<pad>", "<mask>"),
}


@dataclass(frozen=True, slots=True)
class GgufVocabulary:
    """What a GGUF says about its tokenizer (`tokenizer.*` keys; None where absent)."""

    architecture: str
    model: str
    pre: str | None
    tokens: list[str]
    token_types: np.ndarray | None
    scores: np.ndarray | None
    merges: list[str] | None
    special_ids: dict[str, int]  # bos/eos/unk/pad -> id, only those the file names
    add_bos: bool | None
    add_eos: bool | None
    chat_template: str | None


def load_gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of the GGUF at `path` as a transformers fast tokenizer (see the module docstring)."""
    vocabulary = read_gguf_vocabulary(path)
    build = _backend_builder(vocabulary)
    if build is None:
        logger.warning(
            "%s: tokenizer %r with pre-tokenizer %r is not read natively; using transformers' slower conversion",
            path.name,
            vocabulary.model,
            vocabulary.pre,
        )
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return _wrap(build(vocabulary), vocabulary)


def _backend_builder(vocabulary: GgufVocabulary) -> Callable[[GgufVocabulary], Any] | None:
    pre = vocabulary.pre
    if vocabulary.model == "gpt2" and (pre is None or pre in SPLIT_PRE_TOKENIZERS or pre in GPT2_PRE_TOKENIZERS):
        return _byte_level_backend
    if vocabulary.model == "llama" and pre in (None, "default"):  # transformers would split it like a byte-level one
        return _sentencepiece_backend
    return None


def read_gguf_vocabulary(path: Path) -> GgufVocabulary:
    """The `tokenizer.*` fields of a GGUF (and its architecture), checked for the sizes they must agree on."""
    fields = read_gguf_fields(path, lambda key: key.startswith("tokenizer.") or key == "general.architecture")

    def get(key: str, kind: type, required: bool = False) -> Any:
        value = fields.get(key)
        if value is None and required:
            raise SourceError(f"GGUF {path} has no `{key}`: it carries no tokenizer this builder can read")
        if value is not None and not isinstance(value, kind):
            raise SourceError(f"GGUF {path}: `{key}` must be a {kind.__name__}, got {type(value).__name__}")
        return value

    tokens = get("tokenizer.ggml.tokens", list, required=True)
    arrays = {}
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        array = get(key, np.ndarray)
        if array is not None and len(array) != len(tokens):
            raise SourceError(f"GGUF {path}: `{key}` has {len(array)} entries for {len(tokens)} tokens")
        arrays[key] = array
    special_ids = {}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ):
        token_id = get(f"tokenizer.ggml.{key}", int)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise SourceError(
                f"GGUF {path}: `tokenizer.ggml.{key}` {token_id} is outside the {len(tokens)}-token vocabulary"
            )
        if token_id is not None:
            special_ids[name] = token_id
    return GgufVocabulary(
        architecture=get("general.architecture", str, required=True),
        model=get("tokenizer.ggml.model", str, required=True),
        pre=get("tokenizer.ggml.pre", str),
        tokens=tokens,
        token_types=arrays["tokenizer.ggml.token_type"],
        scores=arrays["tokenizer.ggml.scores"],
        merges=get("tokenizer.ggml.merges", list),
        special_ids=special_ids,
        add_bos=get("tokenizer.ggml.add_bos_token", bool),
        add_eos=get("tokenizer.ggml.add_eos_token", bool),
        chat_template=get("tokenizer.chat_template", str),
    )


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> visible character map: printable Latin-1 bytes as themselves, the rest from U+0100."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def _byte_level_backend(vocabulary: GgufVocabulary) -> Any:
    """Byte-level BPE (`tokenizer.ggml.model` gpt2): the file's merges, the pre-tokenizer `ggml.pre` names."""
    from tokenizers import Regex, decoders, pre_tokenizers

    spelling = _byte_alphabet()
    alphabet = frozenset(spelling.values())
    # a file spells its tokens in the byte alphabet already, but for added tokens with other characters
    tokens = [t if alphabet.issuperset(t) else "".join(spelling[b] for b in t.encode()) for t in vocabulary.tokens]
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    merges = _file_merges(vocabulary.merges) if vocabulary.merges is not None else derived_merges(tokens, vocab, None)
    model = {"continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False}
    backend = _bpe_tokenizer(vocab, merges, unk_token=None, **model)
    split = SPLIT_PRE_TOKENIZERS.get(vocabulary.pre or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # a control token with characters outside the byte alphabet is a converter's mislabel (transformers skips it)
    _add_special_tokens(backend, vocabulary, vocab, _CLASS_SPECIALS["gpt2"], lambda t: alphabet.issuperset(t))
    return backend


def _sentencepiece_backend(vocabulary: GgufVocabulary) -> Any:
    """SentencePiece BPE with byte fallback (`tokenizer.ggml.model` llama): merges from the scores, in
    Llama's shape, or Gemma's and Phi-3's (chosen by architecture, as transformers does)."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    style = vocabulary_style(vocabulary.architecture)
    gemma = style is VocabularyStyle.GEMMA
    tokens = vocabulary.tokens
    if gemma:  # Gemma files spell whitespace-only pieces with real spaces; the model's pieces use ▁
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    if vocabulary.merges is not None:
        merges = _file_merges(vocabulary.merges)
    elif gemma:  # Gemma's scores do not follow its merge order; the file's order does
        merges = derived_merges(tokens, vocab, -np.fromiter(vocab.values(), dtype=np.float64, count=len(vocab)))
    elif vocabulary.scores is None:
        raise SourceError(
            "a SentencePiece GGUF vocabulary needs `tokenizer.ggml.scores` (or merges); the file has neither"
        )
    else:  # a token listed twice keeps its last score, as a dict built from the file's lists does
        last_id = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
        merges = derived_merges(tokens, vocab, vocabulary.scores.astype(np.float64)[last_id])
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend = _bpe_tokenizer(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(decode)
    else:
        backend = _bpe_tokenizer(vocab, merges, unk_token=None, fuse_unk=True, byte_fallback=True)
        if style is VocabularyStyle.PHI3:  # the prefix space from a normalizer, as Phi-3's tokenizer.json
            backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
        else:
            backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)])
    _add_special_tokens(backend, vocabulary, vocab, _CLASS_SPECIALS["gemma" if gemma else "llama"], lambda t: True)
    return backend


def _bpe_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> Any:
    """A `tokenizers.Tokenizer` over a BPE model (handed the dict and list directly: twice as fast as
    a JSON document, which `tokenizers` parses slowly)."""
    from tokenizers import Tokenizer, models

    try:
        return Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, ignore_merges=False, **options))
    except Exception as error:  # tokenizers raises bare Exceptions for a malformed model
        raise SourceError(f"the GGUF vocabulary does not make a BPE tokenizer: {error}") from error


def _file_merges(merges: list[str]) -> list[tuple[str, str]]:
    """`tokenizer.ggml.merges` ("left right" each) as pairs, split in C: one join and one split."""
    spaces = np.fromiter(map(str.count, merges, itertools.repeat(" ")), dtype=np.int64, count=len(merges))
    if (spaces != 1).any():
        bad = merges[int(np.flatnonzero(spaces != 1)[0])]
        raise SourceError(f"a `tokenizer.ggml.merges` entry must be two pieces separated by one space, got {bad!r}")
    pieces = " ".join(merges).split(" ")
    return list(zip(pieces[0::2], pieces[1::2], strict=True))


def _add_special_tokens(
    backend: Any,
    vocabulary: GgufVocabulary,
    vocab: dict[str, int],
    class_specials: tuple[str, ...],
    spelled: Callable[[str], bool],
) -> None:
    """Control tokens as special added tokens and user-defined ones as plain added tokens (both matched
    whole in text, as llama.cpp does); the class defaults transformers adds, where the vocabulary has them."""
    from tokenizers import AddedToken

    types = vocabulary.token_types
    control: list[str] = []
    user_defined: list[str] = []
    if types is not None:
        control = [vocabulary.tokens[i] for i in np.flatnonzero(types == _CONTROL).tolist()]
        user_defined = [vocabulary.tokens[i] for i in np.flatnonzero(types == _USER_DEFINED).tolist()]
    specials = [t for t in class_specials if t in vocab] + [t for t in control if spelled(t)]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined if t in vocab])


def _wrap(backend: Any, vocabulary: GgufVocabulary) -> Any:
    """The transformers tokenizer around `backend`: special tokens by the file's ids, add-BOS/EOS flags
    (a SentencePiece file without the flag adds BOS, as llama.cpp does), and the chat template."""
    from transformers import PreTrainedTokenizerFast

    names = {name: vocabulary.tokens[i] for name, i in vocabulary.special_ids.items()}
    kwargs: dict[str, Any] = {f"{name}_token": names.get(name) for name in ("bos", "eos", "unk", "pad")}
    add_bos = vocabulary.add_bos if vocabulary.add_bos is not None else (True if vocabulary.model == "llama" else None)
    if add_bos is not None:
        kwargs["add_bos_token"] = add_bos
    if vocabulary.add_eos is not None:
        kwargs["add_eos_token"] = vocabulary.add_eos
    if vocabulary.chat_template is not None:
        kwargs["chat_template"] = vocabulary.chat_template
    if (
        vocabulary_style(vocabulary.architecture) is VocabularyStyle.GEMMA
        and vocabulary.model == "llama"
        and backend.token_to_id("<mask>") is not None
    ):
        kwargs["mask_token"] = "<mask>"  # GemmaTokenizer's default, which transformers' conversion keeps
    # Given as `tokenizer_object`, the backend would be deep-copied (a full re-parse: a second of a 262k
    # vocabulary); set beforehand, as transformers' own tokenizer classes set theirs, it is used as is.
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tokenizer._tokenizer = backend
    tokenizer.__init__(**kwargs)  # type: ignore[misc]
    return tokenizer
