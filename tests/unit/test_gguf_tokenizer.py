"""builder/gguf_tokenizer.py: a GGUF's tokenizer read from its own vocabulary equals transformers'
GGUF conversion on every tokenizer kind the supported families use (byte-level BPE with each family's
pre-tokenizer, SentencePiece in Llama's, Phi-3's and Gemma's shapes): the backend's JSON, token ids of
a multilingual text with and without special tokens, the chat template's rendering, and the tokenizer
an engine folder saves and `ifb run` loads back."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_vocab import (
    MULTILINGUAL_TEXT,
    GgufVocab,
    byte_level_vocab,
    sentencepiece_model,
    sentencepiece_vocab,
    synthetic_vocab,
    write_tokenizer_gguf,
)

from ifb.builder import bpe_merges, gguf_tokenizer
from ifb.builder.errors import SourceError
from ifb.builder.gguf_tokenizer import load_gguf_tokenizer, read_gguf_vocabulary


@dataclass(frozen=True)
class Kind:
    """One tokenizer kind as a family's GGUF has it: architecture, vocabulary, pre-tokenizer, flags."""

    architecture: str
    vocab: str  # "byte_level", "sentencepiece" or "gemma"
    pre: str | None
    ids: dict[str, Any] = field(default_factory=dict)  # write_tokenizer_gguf's special ids and flags
    turn: tuple[str, str] = ("<|im_start|>", "<|im_end|>")  # the chat template's turn markers


CHATML = dict(bos_id=1, eos_id=2, unk_id=0)
KINDS = {
    "llama3": Kind("llama", "byte_level", "llama-bpe", dict(bos_id=1, eos_id=2, add_bos=True)),
    "smollm2": Kind("llama", "byte_level", "smollm", dict(CHATML, pad_id=2, add_bos=False)),
    "smollm3": Kind("smollm3", "byte_level", "llama-bpe", dict(bos_id=1, eos_id=2, pad_id=0)),
    "qwen2": Kind("qwen2", "byte_level", "qwen2", dict(eos_id=2, pad_id=0, add_bos=False)),
    "qwen3": Kind("qwen3", "byte_level", "qwen2", dict(eos_id=2, pad_id=0)),
    "deepseek-r1-qwen": Kind("qwen2", "byte_level", "deepseek-r1-qwen", dict(bos_id=1, eos_id=2, add_eos=False)),
    "mistral-nemo": Kind("llama", "byte_level", "tekken", dict(bos_id=1, eos_id=2, unk_id=0, add_bos=True)),
    "phi4-mini": Kind("phi3", "byte_level", "gpt-4o", dict(bos_id=0, eos_id=2, pad_id=0)),
    "gpt2-default": Kind("llama", "byte_level", "default", dict(bos_id=1, eos_id=2)),
    "llama2": Kind("llama", "sentencepiece", "default", dict(CHATML), turn=("[INST]", "[/INST]")),
    "mistral": Kind(
        "llama", "sentencepiece", None, dict(CHATML, add_bos=True, add_eos=False), turn=("[INST]", "[/INST]")
    ),
    "phi3": Kind(
        "phi3", "sentencepiece", "default", dict(CHATML, add_bos=False, add_eos=False), turn=("<|user|>", "<|end|>")
    ),
    "gemma2": Kind(
        "gemma2",
        "gemma",
        "default",
        dict(bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_bos=True),
        turn=("<start_of_turn>", "<end_of_turn>"),
    ),
    "gemma3": Kind(
        "gemma3",
        "gemma",
        "default",
        dict(bos_id=2, eos_id=1, unk_id=3, pad_id=0, add_bos=True, add_eos=False),
        turn=("<start_of_turn>", "<end_of_turn>"),
    ),
}
VOCABS = {
    "byte_level": byte_level_vocab,
    "sentencepiece": sentencepiece_vocab,
    "gemma": lambda: sentencepiece_vocab(gemma=True),
}


def chat_template(turn: tuple[str, str]) -> str:
    start, end = turn
    return (
        "{{ bos_token }}{% for m in messages %}"
        + start
        + "{{ m['role'] }}\n{{ m['content'] }}"
        + end
        + "\n{% endfor %}"
        "{% if add_generation_prompt %}" + start + "assistant\n{% endif %}"
    )


MESSAGES = [
    {"role": "system", "content": "You answer in   three languages.\n"},
    {"role": "user", "content": MULTILINGUAL_TEXT},
    {"role": "assistant", "content": "<think>hmm</think> Bonjour, 你好 🙂 42"},
]


def write_kind(folder: Path, name: str) -> Path:
    kind = KINDS[name]
    vocab: GgufVocab = VOCABS[kind.vocab]()
    return write_tokenizer_gguf(
        folder / f"{name}.gguf",
        kind.architecture,
        vocab,
        pre=kind.pre,
        chat_template=chat_template(kind.turn),
        **kind.ids,
    )


def transformers_tokenizer(path: Path) -> Any:
    """transformers' conversion, as `ifb build` called it (with SmolLM3's architecture taught first)."""
    from transformers import AutoTokenizer

    from ifb.builder.families import register_llama_shaped_gguf_architectures

    register_llama_shaped_gguf_architectures()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def special_text(tokenizer: Any) -> str:
    """The multilingual text around every added token of the file's vocabulary, glued to words and spaced."""
    size = tokenizer.vocab_size
    added = sorted(str(token) for i, token in tokenizer.added_tokens_decoder.items() if i < size)
    return " ".join(f"a{token}b {token}" for token in added) + MULTILINGUAL_TEXT + "".join(added)


def backend_json(tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The backend's JSON without the default special tokens transformers appends past the file's vocabulary."""
    document = json.loads(tokenizer.backend_tokenizer.to_str())
    document["added_tokens"] = [token for token in document["added_tokens"] if token["id"] < vocab_size]
    return document


def assert_same_tokenizer(ours: Any, reference: Any) -> None:
    """Equal ids (with and without special tokens), decoding, flags, special tokens and chat template."""
    for text in (MULTILINGUAL_TEXT, special_text(ours), ""):
        for add_special_tokens in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special_tokens)
            assert ids == reference.encode(text, add_special_tokens=add_special_tokens), (text, add_special_tokens)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert (ours.add_bos_token, ours.add_eos_token) == (reference.add_bos_token, reference.add_eos_token)
    assert ours.chat_template == reference.chat_template
    for prompt in (True, False):
        rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert rendered == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        ids = ours.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=prompt, return_dict=False)
        assert ids == reference.apply_chat_template(
            MESSAGES, tokenize=True, add_generation_prompt=prompt, return_dict=False
        )


@pytest.mark.parametrize("name", list(KINDS))
def test_equals_transformers_conversion(tmp_path: Path, name: str) -> None:
    """Every kind: the same backend (model, merges, normalizer, pre-tokenizer, decoder, added tokens,
    post-processor) and the same behaviour as transformers' conversion, in memory and as `ifb run`
    loads it back from the engine folder's `tokenizer/`."""
    from transformers import AutoTokenizer

    path = write_kind(tmp_path, name)
    ours, reference = load_gguf_tokenizer(path), transformers_tokenizer(path)
    size = len(read_gguf_vocabulary(path).tokens)
    assert backend_json(ours, size) == backend_json(reference, size)
    assert len(ours) == size  # nothing appended past the file's vocabulary
    assert_same_tokenizer(ours, reference)
    ours.save_pretrained(tmp_path / "ours")
    reference.save_pretrained(tmp_path / "reference")
    saved, saved_reference = (AutoTokenizer.from_pretrained(tmp_path / n) for n in ("ours", "reference"))
    assert_same_tokenizer(saved, saved_reference)


@pytest.mark.parametrize("gemma", [False, True])
def test_sentencepiece_kinds_use_byte_fallback_and_match_sentencepiece(tmp_path: Path, gemma: bool) -> None:
    """The SentencePiece kinds exercise byte fallback on the multilingual text (emoji, rare scripts);
    Llama's shape gives sentencepiece's own ids for it."""
    name = "gemma3" if gemma else "llama2"
    tokenizer = load_gguf_tokenizer(write_kind(tmp_path, name))
    ids = tokenizer.encode(MULTILINGUAL_TEXT, add_special_tokens=False)
    assert any(token.startswith("<0x") for token in tokenizer.convert_ids_to_tokens(ids))
    assert tokenizer.decode(ids) == MULTILINGUAL_TEXT
    if not gemma:
        assert ids == sentencepiece_model().encode(MULTILINGUAL_TEXT)


def test_tiny_test_gguf(tiny_gguf: Path) -> None:
    """The GGUFs the tests write from a tiny HF checkpoint (gpt2 model, pre `default`)."""
    assert_same_tokenizer(load_gguf_tokenizer(tiny_gguf), transformers_tokenizer(tiny_gguf))


@pytest.mark.slow
def test_bundled_smollm2_gguf() -> None:
    """The real SmolLM2 file (llama.cpp's converter: gpt2 model, pre `smollm`, 17 control tokens), read
    through the builder's metadata path."""
    from ifb.builder.sources import load_metadata, resolve_source

    try:
        source = resolve_source(None)
    except SourceError as error:
        pytest.skip(str(error))
    started = time.perf_counter()
    ours = load_gguf_tokenizer(source.path)
    seconds = time.perf_counter() - started
    reference = transformers_tokenizer(source.path)
    size = len(read_gguf_vocabulary(source.path).tokens)
    assert backend_json(ours, size) == backend_json(reference, size)
    assert_same_tokenizer(ours, reference)
    assert_same_tokenizer(load_metadata(source).tokenizer, reference)
    print(f"SmolLM2 tokenizer read in {seconds:.2f} s")


@pytest.mark.parametrize(("model", "pre"), [("gpt2", "falcon"), ("llama", "llama-bpe"), ("t5", None)])
def test_unknown_kind_falls_back_to_transformers_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, model: str, pre: str | None
) -> None:
    """A pre-tokenizer (or vocabulary model) this module does not know goes to transformers, logged once."""
    vocab = byte_level_vocab() if model == "gpt2" else sentencepiece_vocab()
    path = write_tokenizer_gguf(
        tmp_path / "unknown.gguf",
        "llama",
        GgufVocab(model, vocab.tokens, vocab.token_types, vocab.scores, vocab.merges),
        pre=pre,
        bos_id=1,
        eos_id=2,
        chat_template=chat_template(("<|im_start|>", "<|im_end|>")),
    )
    with caplog.at_level(logging.INFO, logger=gguf_tokenizer.__name__):
        ours = load_gguf_tokenizer(path)
    assert_same_tokenizer(ours, transformers_tokenizer(path))
    lines = [r.getMessage() for r in caplog.records if r.name == gguf_tokenizer.__name__]
    assert len(lines) == 1 and repr(pre) in lines[0] and "transformers" in lines[0], lines


def test_known_kinds_log_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=gguf_tokenizer.__name__):
        load_gguf_tokenizer(write_kind(tmp_path, "qwen2"))
    assert not [r for r in caplog.records if r.name == gguf_tokenizer.__name__]


def test_split_regexes_are_transformers_ones() -> None:
    """Our pre-tokenizer regexes, by `tokenizer.ggml.pre`, are the ones transformers' conversion uses."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    for pre, regex in gguf_tokenizer.SPLIT_PRE_TOKENIZERS.items():
        assert GGUF_PRE_TOKENIZER_SPLITS[pre] == regex, pre


def merges_case() -> tuple[list[str], list[float]]:
    """A vocabulary with what the vectorized split must get right: duplicates (last id and score win),
    tokens past the numpy width (40 characters), equal scores, multi-byte and astral characters."""
    pieces = ["a", "b", "c", "ab", "bc", "abc", "é", "aé", "🙂", "a🙂", "🙂🙂", "a", "ca", "bca", "abca"]
    long = ["ab" * 20, "ab" * 19, "ab" * 10, "ab" * 9 + "a", "b" + "ab" * 9 + "c"]
    tokens = pieces + long + ["".join(p) for p in zip(pieces, reversed(pieces), strict=True)]
    scores = [float(-(i % 7)) for i in range(len(tokens))]
    return tokens, scores


@pytest.mark.parametrize("hash_base", [bpe_merges._HASH_BASE, 1])
def test_derived_merges_equal_transformers_generate_merges(monkeypatch: pytest.MonkeyPatch, hash_base: int) -> None:
    """SentencePiece merges from scores, and byte-level ones from ids, in generate_merges' exact order; a
    hash base of 1 (every anagram collides) sends the work to the exact walk with the same result."""
    from transformers.tokenization_utils_base import generate_merges

    monkeypatch.setattr(bpe_merges, "_HASH_BASE", hash_base)
    trained = sentencepiece_vocab()
    for tokens, scores in (merges_case(), (trained.tokens, trained.scores)):
        vocab = {token: index for index, token in enumerate(tokens)}
        last_id = np.fromiter(vocab.values(), dtype=np.int64)
        expected = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
        derived = bpe_merges.derived_merges(tokens, vocab, np.asarray(scores)[last_id])
        assert derived == expected and len(expected) > 10
        assert bpe_merges.derived_merges(tokens, vocab, None) == generate_merges(vocab)


def test_nul_in_vocabulary_is_split_exactly() -> None:
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["a", "\x00", "a\x00", "\x00a", "a\x00a", "b", "ab", "a\x00b"]
    vocab = {token: index for index, token in enumerate(tokens)}
    assert bpe_merges.derived_merges(tokens, vocab, None) == generate_merges(vocab)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (dict(bos_id=5000, eos_id=2), "`tokenizer.ggml.bos_token_id` 5000 is outside the {}-token vocabulary"),
        (dict(bos_id=1, eos_id=2, pad_id=100000), "`tokenizer.ggml.padding_token_id` 100000 is outside the {}-token"),
    ],
)
def test_special_id_outside_vocabulary_is_refused(tmp_path: Path, ids: dict[str, int], message: str) -> None:
    vocab = byte_level_vocab()
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", "llama", vocab, pre="llama-bpe", **ids)
    with pytest.raises(SourceError, match=message.format(len(vocab.tokens))):
        load_gguf_tokenizer(path)


def test_malformed_merge_is_refused(tmp_path: Path) -> None:
    vocab = byte_level_vocab()
    merges = [*vocab.merges[:10], "Ġa b c", *vocab.merges[10:]]  # type: ignore[index]
    bad = GgufVocab("gpt2", vocab.tokens, vocab.token_types, merges=merges)
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", "qwen2", bad, pre="qwen2", eos_id=0)
    with pytest.raises(SourceError, match="two pieces separated by one space, got 'Ġa b c'"):
        load_gguf_tokenizer(path)


def test_file_without_tokenizer_or_not_gguf_is_refused(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SourceError, match="has no `tokenizer.ggml.tokens`"):
        load_gguf_tokenizer(tmp_path / "bare.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(SourceError, match="GGUF magic"):
        load_gguf_tokenizer(tmp_path / "text.gguf")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(write_kind(tmp_path, "qwen2").read_bytes()[:5000])
    with pytest.raises(SourceError, match="past the end of the file|unpack"):
        load_gguf_tokenizer(truncated)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_read_time_of_a_262k_vocabulary(tmp_path: Path, model: str) -> None:
    """Reports (does not assert) the read time of a Gemma-sized vocabulary: 262,144 tokens, SentencePiece
    (merges derived from scores) or byte-level (merges from the file). The tokenizer round-trips text."""
    path = write_tokenizer_gguf(
        tmp_path / f"{model}.gguf",
        "gemma3" if model == "llama" else "qwen2",
        synthetic_vocab(262144, model),
        pre="default" if model == "llama" else "qwen2",
        bos_id=1,
        eos_id=2,
    )
    started, cpu = time.perf_counter(), time.process_time()
    tokenizer = load_gguf_tokenizer(path)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu
    assert len(tokenizer) == 262144
    text = "abc déjà 日本語 🙂 12345\n\n  x"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    print(f"262k {model} vocabulary read in {seconds:.2f} s wall, {cpu_seconds:.2f} s CPU")
