"""A guided request's output is well-formed UTF-8: xgrammar's byte-level matching accepts the
3-byte encodings of U+D800..U+DFFF (ED A0..BF xx), which decode to three U+FFFD each (issue #23);
the request's matcher refuses them, and nothing else."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).parents[1]))
from tiny_models import tiny_tokenizer  # noqa: E402

from ifb.runtime.guided import CompiledGuide, GuidedMatcher, SurrogateGuard  # noqa: E402

STRING_SCHEMA = {"type": "string", "maxLength": 4}


@pytest.fixture(scope="module")
def string_guide() -> tuple[CompiledGuide, dict[int, int], int]:
    """A maxLength-4 JSON string on the tiny byte-level tokenizer, its single-byte tokens and
    the vocabulary's size."""
    tokenizer = tiny_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[2])
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL  # byte tokens are bytes, not "<0xE7>" text
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(STRING_SCHEMA))
    byte_tokens = {data[0]: token for token, data in enumerate(info.decoded_vocab) if len(data) == 1}
    assert len(byte_tokens) == 256
    guard = SurrogateGuard.from_vocab(info.decoded_vocab, len(tokenizer))
    return CompiledGuide(compiled, guard), byte_tokens, len(tokenizer)


def accept_bytes(matcher: GuidedMatcher, byte_tokens: dict[int, int], data: bytes) -> bool:
    return all(matcher.accept_token(byte_tokens[byte]) for byte in data)


def offered(matcher: GuidedMatcher, token: int, vocab_size: int) -> bool:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return not bool(torch.isneginf(logits[0, token]))


def well_formed(lead: int, second: int) -> bool:
    """Whether some UTF-8 sequence starts with these two bytes (any further bytes as 0x80)."""
    length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    try:
        bytes([lead, second, *[0x80] * (length - 2)]).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_string_takes_exactly_the_well_formed_utf8_sequences(string_guide: tuple[CompiledGuide, Any, int]) -> None:
    """Every lead byte and second byte, offered by the mask and accepted, is the start of a
    well-formed sequence, and every such start is offered: the mask and accept_token agree."""
    guide, byte_tokens, vocab_size = string_guide
    matcher = guide.matcher()
    assert accept_bytes(matcher, byte_tokens, b'"')
    wrong = []
    for lead in range(0x80, 0x100):
        if not matcher.accept_token(byte_tokens[lead]):
            assert lead < 0xC2 or lead > 0xF4, hex(lead)  # only bytes no sequence starts with
            continue
        for second in range(0x80, 0x100):
            is_offered = offered(matcher, byte_tokens[second], vocab_size)
            accepted = matcher.accept_token(byte_tokens[second])
            if accepted:
                matcher.rollback(1)
            if not is_offered == accepted == well_formed(lead, second):
                wrong.append((hex(lead), hex(second), is_offered, accepted))
        matcher.rollback(1)
    assert not wrong, wrong


def test_the_surrogates_neighbours_count_one_character_each(string_guide: tuple[CompiledGuide, Any, int]) -> None:
    """U+D7FF and U+E000 (ED 9F BF, EE 80 80) are characters: four fill maxLength 4, a fifth
    is refused."""
    guide, byte_tokens, _ = string_guide
    matcher = guide.matcher()
    assert accept_bytes(matcher, byte_tokens, '"\ud7ff\ue000\ud7ff\ue000'.encode())
    assert not matcher.accept_token(byte_tokens[0xED])
    assert matcher.accept_token(byte_tokens[ord('"')])


def test_rollback_forgets_a_trailing_lead_byte(string_guide: tuple[CompiledGuide, Any, int]) -> None:
    """After ED is rolled back, E7 A0 (a CJK character's start) is accepted again."""
    guide, byte_tokens, _ = string_guide
    matcher = guide.matcher()
    assert accept_bytes(matcher, byte_tokens, b'"\xed')
    assert not matcher.accept_token(byte_tokens[0xA0])  # ED A0: U+D800's would-be encoding
    matcher.rollback(1)
    assert accept_bytes(matcher, byte_tokens, b"\xe7\xa0\x80")


def test_the_guard_reads_multi_byte_tokens() -> None:
    vocab = [b"a", b"\xed", b"\xa0", b"x\xed\xa5y", b"\xed\x9f", b"", b"\x9f\xed"]
    guard = SurrogateGuard.from_vocab(vocab, 40)
    assert guard.anywhere == {3}  # holds a whole encoded surrogate: never offered
    assert guard.after_lead == {2, 3}  # would finish one after an output ending in ED
    assert guard.ends_in_lead == {1, 6}
    assert guard.empty == {5, *range(7, 40)}
    assert guard.leaves_lead(5, after_lead=True) and not guard.leaves_lead(5, after_lead=False)
    logits = torch.zeros(1, 40)
    xgr.apply_token_bitmask_inplace(logits, guard.after_lead_mask[None])
    assert torch.isneginf(logits[0]).nonzero().flatten().tolist() == [2, 3]
