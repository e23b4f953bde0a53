"""A GGUF's tokenizer built from its own `tokenizer.ggml.*` vocabulary with `tokenizers`, in seconds.

transformers' GGUF conversion reads the same fields, but through a per-element reader and a Python
merge derivation: 116 s for Gemma 3's 262k vocabulary. This module reads the header itself (numeric
arrays as numpy views, each string array in one pass), derives SentencePiece merges with one sort,
and hands `tokenizers` one JSON document. The result is the tokenizer transformers' conversion makes
(`transformers.integrations.gguf.gguf_tokenizer_mapping`): the same model, normalizer, pre-tokenizer,
decoder, added tokens, special tokens, add-BOS/EOS flags and chat template, so the engine folder's
`tokenizer/` and every id it gives are unchanged. One deliberate difference: transformers' conversion
appends its tokenizer classes' default special tokens that the file lacks (`<|endoftext|>` after a
Llama 3 vocabulary), ids past the model's vocabulary; those are left out.

A vocabulary kind or pre-tokenizer this module does not know is handed to transformers (one log line).
"""

from __future__ import annotations

import logging
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ifb.builder.errors import SourceError

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
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
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


# GGUF metadata value types: fixed-size scalars by numpy dtype; 8 is a string, 9 an array
_SCALAR_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def read_gguf_fields(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values whose keys `wanted` accepts: scalars as Python values, numeric arrays as numpy
    arrays, string arrays as lists (each walked once; gguf's GGUFReader takes ~40 s on a 262k vocabulary
    because it makes numpy views per element)."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read_fields(buf, wanted)
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        raise SourceError(f"cannot read the metadata of GGUF {path}: {error}") from error


def _read_fields(buf: mmap.mmap, wanted: Callable[[str], bool]) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ValueError("the file does not start with the GGUF magic")
    version, _, num_fields = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not 2 or 3")
    fields: dict[str, Any] = {}
    pos = 24
    for _ in range(num_fields):
        key, pos = _read_string(buf, pos)
        (value_type,) = _U32.unpack_from(buf, pos)
        keep = wanted(key)
        value, pos = _read_value(buf, pos + 4, value_type, keep)
        if keep:
            fields[key] = value
    return fields


def _read_value(buf: mmap.mmap, pos: int, value_type: int, keep: bool) -> tuple[Any, int]:
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type in _SCALAR_DTYPES:
        dtype = np.dtype(_SCALAR_DTYPES[value_type])
        value = np.frombuffer(buf[pos : pos + dtype.itemsize], dtype)[0].item()
        return (bool(value) if value_type == _BOOL else value), pos + dtype.itemsize
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type}")
    element_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element_type in _SCALAR_DTYPES:
        dtype = np.dtype(_SCALAR_DTYPES[element_type])
        end = pos + count * dtype.itemsize
        if end > len(buf):
            raise ValueError(f"an array of {count} values runs past the end of the file")
        if not keep:
            return None, end
        array = np.frombuffer(buf[pos:end], dtype)
        return (array.astype(bool) if element_type == _BOOL else array), end
    if element_type == _STRING:
        return _read_strings(buf, pos, count, keep)
    if element_type == _ARRAY:  # nested arrays: no tokenizer field uses them; walked past
        for _ in range(count):
            _, pos = _read_value(buf, pos, _ARRAY, False)
        return None, pos
    raise ValueError(f"unknown GGUF array element type {element_type}")


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise ValueError(f"a {length}-byte string runs past the end of the file")
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_strings(buf: mmap.mmap, pos: int, count: int, keep: bool) -> tuple[list[str] | None, int]:
    """A string array in one pass: each element is a u64 length then its bytes, so the walk is sequential."""
    unpack = _U64.unpack_from
    if not keep:
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        return None, pos
    values: list[str] = []
    append = values.append
    for _ in range(count):
        (length,) = unpack(buf, pos)
        pos += 8
        append(buf[pos : pos + length].decode("utf-8"))
        pos += length
    if pos > len(buf):
        raise ValueError(f"an array of {count} strings runs past the end of the file")
    return values, pos


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
    merges = _file_merges(vocabulary.merges) if vocabulary.merges is not None else _derived_merges(tokens, vocab, None)
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

    gemma = vocabulary.architecture in GEMMA_ARCHITECTURES
    tokens = vocabulary.tokens
    if gemma:  # Gemma files spell whitespace-only pieces with real spaces; the model's pieces use ▁
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    if vocabulary.merges is not None:
        merges = _file_merges(vocabulary.merges)
    elif gemma:  # Gemma's scores do not follow its merge order; the file's order does
        merges = _derived_merges(tokens, vocab, -np.fromiter(vocab.values(), dtype=np.float64, count=len(vocab)))
    elif vocabulary.scores is None:
        raise SourceError(
            "a SentencePiece GGUF vocabulary needs `tokenizer.ggml.scores` (or merges); the file has neither"
        )
    else:  # a token listed twice keeps its last score, as a dict built from the file's lists does
        last_id = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
        merges = _derived_merges(tokens, vocab, vocabulary.scores.astype(np.float64)[last_id])
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend = _bpe_tokenizer(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(decode)
    else:
        backend = _bpe_tokenizer(vocab, merges, unk_token=None, fuse_unk=True, byte_fallback=True)
        if vocabulary.architecture == "phi3":  # the prefix space from a normalizer, as Phi-3's tokenizer.json
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
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        bad = next(merge for merge, pair in zip(merges, pairs, strict=True) if len(pair) != 2)
        raise SourceError(f"a `tokenizer.ggml.merges` entry must be two pieces separated by one space, got {bad!r}")
    return pairs  # type: ignore[return-value]


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


def _derived_merges(tokens: list[str], vocab: dict[str, int], scores: np.ndarray | None) -> list[tuple[str, str]]:
    """The BPE merges a vocabulary implies, in the order of transformers' `generate_merges`: every split of
    a token into two vocabulary pieces; with `scores` (one per distinct token, in `vocab`'s order) the best
    scored merged token first, then the longer left piece, the longer right piece; without, the lowest id
    first, then the shorter pieces; ties by the token's place in `vocab`, then the pieces' ids."""
    keys = list(vocab)  # distinct tokens, first-occurrence order; vocab holds each one's last id
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(keys))
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    position, left, right, left_length = _splits(keys, ids, lengths, vocab)
    right_length = lengths[position] - left_length
    if scores is None:
        primary = (right_length, left_length, ids[position])
    else:
        primary = (-right_length, -left_length, -scores[position])
    order = np.lexsort((right, left, position, *primary))
    spelled = np.array(tokens, dtype=object)
    return list(zip(spelled[left[order]].tolist(), spelled[right[order]].tolist(), strict=True))


_VECTOR_WIDTH = 32  # tokens up to this many characters are split in numpy (almost all of any vocabulary)
_HASH_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64


def _splits(
    keys: list[str], ids: np.ndarray, lengths: np.ndarray, vocab: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (token position, left id, right id, left length) where both halves are in the vocabulary.

    Tokens of up to _VECTOR_WIDTH characters are split in numpy, one split position at a time across all
    of them: each token's code points get a polynomial hash modulo 2**64 whose prefix sums give every
    prefix's hash and, times an inverse power of the base, every suffix's; a half is found by binary
    search among the sorted whole-token hashes, and every pair found is then compared code point by code
    point, so a hash collision can only send the work to the exact Python walk, never give a wrong merge.
    Longer tokens (and a vocabulary with a NUL, which numpy strings cannot hold) take that walk directly."""
    vectorized = np.flatnonzero(lengths <= _VECTOR_WIDTH)
    if "\x00" in "".join(keys):
        vectorized = vectorized[:0]
    found = _hashed_splits(keys, ids, lengths, vectorized) if len(vectorized) else []
    if found is None:
        vectorized, found = vectorized[:0], []
    walked = np.ones(len(keys), dtype=bool)
    walked[vectorized] = False
    for p in np.flatnonzero(walked).tolist():
        word = keys[p]
        for split in range(1, len(word)):
            left_id, right_id = vocab.get(word[:split]), vocab.get(word[split:])
            if left_id is not None and right_id is not None:
                found.append(tuple(np.array([value]) for value in (p, left_id, right_id, split)))
    if not found:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))  # type: ignore[return-value]
    return tuple(np.concatenate(column) for column in zip(*found, strict=True))  # type: ignore[return-value]


def _hashed_splits(
    keys: list[str], ids: np.ndarray, lengths: np.ndarray, rows: np.ndarray
) -> list[tuple[np.ndarray, ...]] | None:
    """_splits' numpy part for the tokens at `rows`; None on a hash collision."""
    width = int(lengths[rows].max())
    points = np.array([keys[i] for i in rows.tolist()], dtype=f"<U{width}").view(np.uint32).reshape(len(rows), width)
    modulus = 1 << 64
    powers = np.array([pow(_HASH_BASE, j, modulus) for j in range(width)], dtype=np.uint64)
    inverse = pow(_HASH_BASE, -1, modulus)
    prefix = np.cumsum(points.astype(np.uint64) * powers, axis=1, dtype=np.uint64)
    whole = prefix[:, -1]
    own_lengths = lengths[rows]
    order = np.argsort(whole)
    sorted_hash = whole[order]

    def lookup(hashes: np.ndarray, expected_lengths: np.ndarray) -> np.ndarray:
        """The row (into `rows`) holding a token with this hash and length, or -1."""
        at = order[np.searchsorted(sorted_hash, hashes) % len(order)]
        return np.where((whole[at] == hashes) & (own_lengths[at] == expected_lengths), at, -1)

    found: list[tuple[np.ndarray, ...]] = []
    for split in range(1, width):
        words = np.flatnonzero(own_lengths > split)
        left_hash = prefix[words, split - 1]
        right_hash = (whole[words] - left_hash) * np.uint64(pow(inverse, split, modulus))
        left = lookup(left_hash, np.full(len(words), split))
        right = lookup(right_hash, own_lengths[words] - split)
        both = (left >= 0) & (right >= 0)
        words, left, right = words[both], left[both], right[both]
        same_left = (points[words, :split] == points[left, :split]).all(axis=1)
        same_right = (points[words, split:] == points[right, : width - split]).all(axis=1)
        if not (same_left.all() and same_right.all()):
            return None
        found.append((rows[words], ids[rows[left]], ids[rows[right]], np.full(len(words), split)))
    return found


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
        vocabulary.architecture in GEMMA_ARCHITECTURES
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
