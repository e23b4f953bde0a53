"""GGUF files that hold a tokenizer in llama.cpp's layout (and no weights): byte-level BPE vocabularies with
merges, SentencePiece vocabularies with scores and byte fallback, trained in-process on a fixed corpus."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# English, accents, Greek/Cyrillic/Arabic/Devanagari, CJK, emoji (with a skin-tone modifier and a ZWJ
# sequence), digits and numbers, runs of spaces and tabs, newlines and CRLF, contractions, code.
MULTILINGUAL_TEXT = (
    "Hello world! The café's naïve façade — déjà vu, isn't it? We'll see: I'm sure they've gone.\n"
    "Ελληνικά κείμενα, русский текст, العربية, हिन्दी और 한국어 텍스트.\n"
    "日本語のテキストと中文字符，混合在一起。 Ünïcödé ß ø å ñ ç.\n"
    "Emoji: 🙂🚀👍🏽 👨‍👩‍👧 ❤️ done.\n"
    "Numbers: 12345 3.14159 1,000,000 2026-12-03 0x1F ½ ² ٣.\n"
    "    four leading spaces\n\ttab\tseparated\t\tcolumns   and   runs     of spaces  \n\n\n"
    "def f(x):\r\n    return x**2  # comment\r\n"
    "  trailing and leading  "
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog and the cat sat on the mat",
    "in flight batching admits requests between steps while paged attention stores blocks",
    "hello world, this is a tokenizer test with numbers 0123456789 and 2026 and 3.14",
    "café naïve façade déjà vu über straße smörgåsbord piñata crème brûlée",
    "Ελληνικά κείμενα και λέξεις, русский текст и слова, العربية والكلمات",
    "日本語のテキストと中文字符，混合在一起。한국어 텍스트와 단어들",
    "def main():\n    return 0\n\n\nclass Foo:\n\tpass  # comment",
    "    indented line with   several   spaces and\ttabs\t\tand\nnewlines\n\n",
    "isn't it? we'll see, I'm sure they've gone and you'd know, he's here",
] * 30


@dataclass(frozen=True, slots=True)
class GgufVocab:
    """A vocabulary as llama.cpp's converter writes it under `tokenizer.ggml.*`."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None


def byte_level_vocab(
    vocab_size: int = 700,
    specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    user_defined: tuple[str, ...] = ("<think>", "</think>"),
) -> GgufVocab:
    """A byte-level BPE (GPT-2 alphabet) trained on CORPUS; specials are CONTROL (3), user_defined
    USER_DEFINED (4), as llama.cpp marks a tokenizer.json's added tokens."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])] + list(user_defined)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in specials else 4 if t in user_defined else 1 for t in tokens]
    return GgufVocab("gpt2", tokens, types, merges=merges)


GEMMA_USER_DEFINED = ["<start_of_turn>", "<end_of_turn>"]


def sentencepiece_model(vocab_size: int = 900, gemma: bool = False) -> Any:
    """A SentencePiece BPE with byte fallback trained on CORPUS with Llama 2's trainer settings; `gemma`:
    Gemma's ids (pad 0, eos 1, bos 2, unk 3, mask 4) and turn markers as user-defined pieces."""
    import sentencepiece as spm

    ids: dict[str, Any] = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    if gemma:
        ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, bos_piece="<bos>", eos_piece="<eos>")
        ids.update(control_symbols=["<mask>"], user_defined_symbols=GEMMA_USER_DEFINED)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.99,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        add_dummy_prefix=True,
        num_threads=1,
        minloglevel=2,
        **ids,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_vocab(vocab_size: int = 900, gemma: bool = False) -> GgufVocab:
    """sentencepiece_model's vocabulary as llama.cpp's `_set_vocab_sentencepiece` writes it: piece, score
    and type per id. `gemma`: whitespace-only pieces spelled with real spaces, as Gemma files have them,
    and scores that do not follow the merge order (in Gemma's files the order of the tokens does)."""
    import random

    processor = sentencepiece_model(vocab_size, gemma)
    user_defined = GEMMA_USER_DEFINED if gemma else []
    tokens, scores, types = [], [], []
    for i in range(processor.vocab_size()):
        piece = processor.id_to_piece(i)
        kind = 1
        if processor.is_unknown(i):
            kind = 2
        elif processor.is_control(i):
            kind = 3
        elif processor.is_unused(i):
            kind = 5
        elif processor.is_byte(i):
            kind = 6
        elif piece in user_defined:
            kind = 4
        if gemma and piece.strip("\u2581") == "" and len(piece) > 1:
            piece = " " * len(piece)
        tokens.append(piece)
        scores.append(processor.get_score(i))
        types.append(kind)
    if gemma:
        random.Random(0).shuffle(scores)
    return GgufVocab("llama", tokens, types, scores=scores)


def write_tokenizer_gguf(
    path: Path,
    architecture: str,
    vocab: GgufVocab,
    *,
    pre: str | None,
    bos_id: int | None = None,
    eos_id: int | None = None,
    unk_id: int | None = None,
    pad_id: int | None = None,
    add_bos: bool | None = None,
    add_eos: bool | None = None,
    add_space_prefix: bool | None = None,
    chat_template: str | None = None,
) -> Path:
    """A GGUF with the metadata transformers needs to read its config, the tokenizer, and no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(f"vocab-{architecture}")
    for key, value in _config_fields(len(vocab.tokens)).items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_float32(f"{architecture}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{architecture}.rope.freq_base", 10000.0)
    writer.add_tokenizer_model(vocab.model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    optional: dict[str, Any] = {
        "add_bos_token_id": bos_id,
        "add_eos_token_id": eos_id,
        "add_unk_token_id": unk_id,
        "add_pad_token_id": pad_id,
        "add_add_bos_token": add_bos,
        "add_add_eos_token": add_eos,
        "add_chat_template": chat_template,
    }
    for method, value in optional.items():
        if value is not None:
            getattr(writer, method)(value)
    if add_space_prefix is not None:
        writer.add_bool("tokenizer.ggml.add_space_prefix", add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _config_fields(vocab_size: int) -> dict[str, int]:
    return {
        "context_length": 256,
        "embedding_length": 64,
        "block_count": 2,
        "feed_forward_length": 128,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
        "attention.value_length": 16,
        "vocab_size": vocab_size,
    }


def synthetic_vocab(size: int, model: str, seed: int = 0) -> GgufVocab:
    """A `size`-token vocabulary shaped like a trained one (every token above the alphabet is the
    concatenation of two earlier ones, its merge), for timing the read of Gemma-sized vocabularies.
    `model` "llama": SentencePiece pieces (▁ for space, <0xXX> bytes, scores falling with the rank);
    "gpt2": the byte-level alphabet with merges."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if model == "gpt2":
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        alphabet = sorted(set(bytes_to_unicode().values()))
        tokens = ["<|endoftext|>", *alphabet]
        types = [3] + [1] * len(alphabet)
        start = 1
    else:
        letters = [chr(c) for c in range(0x61, 0x7B)] + ["\u2581"] + [chr(0x4E00 + i) for i in range(4000)]
        tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *letters]
        types = [2, 3, 3] + [6] * 256 + [1] * len(letters)
        start = 3 + 256
    base = len(tokens)
    seen = set(tokens)
    merges: list[str] = []
    lengths = [len(t) for t in tokens]
    while len(tokens) < size:
        # favour recent (longer) tokens on the left and short ones on the right, as trained merges do
        left = rng.integers(start, len(tokens), 2048)
        right = rng.integers(start, start + (len(tokens) - start) // 8 + 1, 2048)
        for i, j in zip(left.tolist(), right.tolist(), strict=True):
            if lengths[i] + lengths[j] > 16:
                continue
            token = tokens[i] + tokens[j]
            if token in seen:
                continue
            seen.add(token)
            tokens.append(token)
            lengths.append(len(token))
            types.append(1)
            merges.append(f"{tokens[i]} {tokens[j]}")
            if len(tokens) == size:
                break
    if model == "gpt2":
        return GgufVocab("gpt2", tokens, types, merges=merges)
    scores = [0.0] * base + [-float(i) for i in range(size - base)]
    return GgufVocab("llama", tokens, types, scores=scores)
