"""IncrementalDetokenizer: stop-string holdback, stops across tokens, final flush, streamed text = full decode."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from byte_fallback import byte_fallback_tokenizer, byte_token, piece
from tiny_models import tiny_tokenizer

from ifb.runtime.detokenizer import IncrementalDetokenizer

# Hand-picked pieces, so each test chooses exactly where token boundaries fall.
PIECES = ["<unk>", "</s>", "Hel", "lo", " wo", "rld", " ST", "OP", "!", " S", "T", "x"]
ID = {piece: index for index, piece in enumerate(PIECES)}


@pytest.fixture(scope="module")
def pieces_tokenizer() -> Any:
    """A WordLevel tokenizer whose decode is the plain concatenation of the pieces."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(dict(ID), unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Any:
    return tiny_tokenizer()


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Push tokens one at a time, taking the non-final delta after each."""
    deltas = []
    for token in token_ids:
        detok.push([token])
        deltas.append(detok.take(final=False))
    return deltas


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def test_text_that_could_become_a_stop_string_is_held_back(pieces_tokenizer: Any) -> None:
    """After ' ST' (a possible start of 'STOP') nothing of 'ST' has been emitted yet."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("x"), stop=("STOP",))
    emitted = "".join(stream(detok, ids("Hel", "lo", " wo", "rld", " ST")))
    assert "S" not in emitted
    assert emitted.rstrip() == "Hello world"
    assert not detok.stopped


def test_stop_string_spanning_two_tokens_is_found_and_cut(pieces_tokenizer: Any) -> None:
    """' ST' + 'OP' completes 'STOP': the request stops and the stream ends right before it."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("x"), stop=("STOP",))
    deltas = stream(detok, ids("Hel", "lo", " wo", "rld", " ST", "OP"))
    assert detok.stopped
    assert "".join(deltas) == "Hello world "
    assert all("S" not in delta for delta in deltas)  # the held-back part was never shown


def test_stop_string_inside_one_token_is_cut(pieces_tokenizer: Any) -> None:
    """A stop string in the middle of a single token cuts the text there."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("x"), stop=("rl",))
    deltas = stream(detok, ids("Hel", "lo", " wo", "rld"))
    assert detok.stopped
    assert "".join(deltas) == "Hello wo"


def test_stop_string_in_the_prompt_does_not_stop_the_output(pieces_tokenizer: Any) -> None:
    """Only generated text is searched: a prompt ending in ' ST' plus an output 'OP' is no stop."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("Hel", " ST"), stop=("STOP",))
    deltas = stream(detok, ids("OP", "!"))
    assert not detok.stopped
    assert "".join(deltas) + detok.take(final=True) == "OP!"


def test_final_take_flushes_the_held_back_text(pieces_tokenizer: Any) -> None:
    """take(final=True) returns the held-back tail; nothing is lost when no stop completes."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("x"), stop=("STOP",))
    deltas = stream(detok, ids("Hel", "lo", " ST"))
    tail = detok.take(final=True)
    assert tail.endswith(" ST")
    assert "".join(deltas) + tail == "Hello ST"
    assert detok.take(final=True) == ""  # flushed once


def test_without_stop_strings_every_token_is_emitted_at_once(pieces_tokenizer: Any) -> None:
    """No stop strings: each take right after a push returns exactly that token's text."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("x"), stop=())
    tokens = ids("Hel", "lo", " ST", "OP", "!")
    assert stream(detok, tokens) == ["Hel", "lo", " ST", "OP", "!"]


def test_special_tokens_add_no_text(pieces_tokenizer: Any) -> None:
    """An EOS token decodes to nothing (skip_special_tokens), and later text still streams."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("x"), stop=())
    assert stream(detok, ids("Hel", "</s>", "lo")) == ["Hel", "", "lo"]


@pytest.mark.parametrize("stop", [(), ("zzz",), ("quick brown fox jumps",)])
def test_concatenated_deltas_equal_the_full_decode(bpe_tokenizer: Any, stop: tuple[str, ...]) -> None:
    """Byte-level BPE with multi-byte characters split across tokens: the stream equals decode()."""
    prompt = bpe_tokenizer.encode("paged attention", add_special_tokens=False)
    text = " hello wörld, héllo the quick brown fox ✓ 0123"
    output = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert len(output) > len(text.split())  # some characters really span several tokens
    detok = IncrementalDetokenizer(bpe_tokenizer, prompt, stop=stop)
    deltas = stream(detok, output) + [detok.take(final=True)]
    assert not any("\ufffd" in delta for delta in deltas)
    assert "".join(deltas) == bpe_tokenizer.decode(output) == text


@pytest.mark.parametrize(
    "stop",
    [
        ("orl", "rld"),
        ("rld", "orl"),
    ],
)
def test_earliest_stop_string_wins_whatever_the_list_order(pieces_tokenizer: Any, stop: tuple[str, ...]) -> None:
    """'rld' completes 'orl' (at 7) and 'rld' (at 8) in one push: the text ends before the earlier, 'Hello w'."""
    detok = IncrementalDetokenizer(pieces_tokenizer, ids("x"), stop=stop)
    deltas = stream(detok, ids("Hel", "lo", " wo", "rld"))
    assert detok.stopped
    assert "".join(deltas) == "Hello w"


@pytest.mark.parametrize("tail_decoder", [False, True], ids=["decode_stream", "tail_decode"])
def test_special_tokens_are_text_only_when_asked(pieces_tokenizer: Any, bpe_tokenizer: Any, tail_decoder: bool) -> None:
    """skip_special_tokens=False (vLLM's field) keeps a special token's text, on both decoders (a
    tokenizer that cleans up spaces in Python streams through `tokenizer.decode`)."""
    for tokenizer, special, word in ((pieces_tokenizer, ID["</s>"], ID["Hel"]), (bpe_tokenizer, 1, 40)):
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.clean_up_tokenization_spaces = tail_decoder
        shown, hidden = (IncrementalDetokenizer(tokenizer, [], (), skip) for skip in (False, True))
        for detok in (shown, hidden):
            detok.push([word, special, word])
        text = tokenizer.decode([word])
        assert hidden.take(final=True) == text + text
        assert shown.take(final=True) == text + tokenizer.convert_ids_to_tokens(special) + text


# -- byte fallback (SentencePiece vocabularies: Gemma, Llama 2, Mistral) --------------------------
X, E2, J = byte_token(0x78), byte_token(0xE2), piece("j")  # "x" as a byte token, a lone lead byte, "j"
DECODERS = pytest.mark.parametrize("strip_leading_space", [False, True], ids=["gemma", "llama2"])


@DECODERS
def test_decode_stream_raises_on_an_ascii_byte_then_an_invalid_byte(strip_leading_space: bool) -> None:
    """The seam the next tests go through: tokenizers' DecodeStream streams the byte token 0x78
    as "x", then a lone 0xE2 and "j" decode as "\ufffd\ufffdj" and it raises (the defect of
    issue 41, the same message as the Gemma 2 run). If a tokenizers release stops raising,
    this fails and says the recovery is no longer exercised."""
    from tokenizers.decoders import DecodeStream

    tokenizer = byte_fallback_tokenizer(strip_leading_space)
    assert tokenizer.decode([X, E2, J]) == "\ufffd\ufffdj"
    stream = DecodeStream([], skip_special_tokens=True)
    assert stream.step(tokenizer.backend_tokenizer, X) == "x"
    assert stream.step(tokenizer.backend_tokenizer, E2) is None
    with pytest.raises(Exception, match="Invalid prefix encountered.*Expected prefix: 'x'"):
        stream.step(tokenizer.backend_tokenizer, J)


@DECODERS
def test_byte_fallback_text_survives_an_invalid_prefix(strip_leading_space: bool) -> None:
    """The sequence that makes DecodeStream raise streams on: "x" stays sent, the stream restarts
    from the tokens not yet shown, and the text is the bytes' lossy UTF-8 decode ("x\ufffdj"),
    with the following word's space kept."""
    tokenizer = byte_fallback_tokenizer(strip_leading_space)
    prompt = tokenizer.encode(" the quick", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=())
    deltas = stream(detok, [X, E2, J, piece("▁world"), E2, byte_token(0x9C), byte_token(0x93)])
    text = "".join(deltas) + detok.take(final=True)
    assert text == b"x\xe2j".decode("utf-8", "replace") + " world✓" == "x\ufffdj world✓"


def test_byte_fallback_failure_with_the_ascii_byte_in_the_prompt() -> None:
    """The prompt ends with the byte token "x" (the stream's context) and the output is 0xE2, "j":
    what the end-to-end test forces; the output's own text comes out."""
    tokenizer = byte_fallback_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, [piece("▁hello"), X], stop=())
    assert "".join(stream(detok, [E2, J])) + detok.take(final=True) == "\ufffdj"


@DECODERS
def test_a_prompt_ending_mid_character_is_not_repeated(strip_leading_space: bool) -> None:
    """A prompt (given as token ids) that ends inside a character gave DecodeStream no prefix, so
    the first output repeated the prompt's text (" hello✓" for the output "✓"'s last byte)."""
    tokenizer = byte_fallback_tokenizer(strip_leading_space)
    detok = IncrementalDetokenizer(tokenizer, [piece("▁hello"), E2, byte_token(0x9C)], stop=())
    text = "".join(stream(detok, [byte_token(0x93), piece("▁world")])) + detok.take(final=True)
    assert text == "\ufffd world"


@DECODERS
def test_random_byte_fallback_outputs_never_raise(strip_leading_space: bool) -> None:
    """Seeded random outputs over ASCII, lead and continuation bytes and words: the detokenizer
    never raises, and an output whose bytes are valid UTF-8 streams exactly its full decode."""
    tokenizer = byte_fallback_tokenizer(strip_leading_space)
    choices = [byte_token(v) for v in (0x78, 0x41, 0xE2, 0xC3, 0x9C, 0x93, 0xA9)] + [J, piece("▁the"), piece("▁")]
    rng = random.Random(41)
    num_invalid = 0
    for _ in range(300):
        output = [rng.choice(choices) for _ in range(rng.randint(1, 12))]
        detok = IncrementalDetokenizer(tokenizer, [piece("▁hello")], stop=())
        text = "".join(stream(detok, output)) + detok.take(final=True)
        full = tokenizer.decode([piece("▁hello"), *output])
        if "\ufffd" in full:
            num_invalid += 1
        else:
            assert tokenizer.decode([piece("▁hello")]) + text == full, output
    assert 50 < num_invalid < 300  # both kinds were drawn
