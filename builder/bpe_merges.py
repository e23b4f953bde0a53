"""The BPE merges a SentencePiece vocabulary implies (it stores scores, not merges), vectorized.

transformers' `generate_merges` walks every split of every token in Python (seconds to minutes on a
262k vocabulary); this gives the same list in the same order with numpy.
"""

from __future__ import annotations

import numpy as np


def derived_merges(tokens: list[str], vocab: dict[str, int], scores: np.ndarray | None) -> list[tuple[str, str]]:
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
        has_left = left >= 0  # the right halves of those only: half the binary searches
        words, left, right_hash = words[has_left], left[has_left], right_hash[has_left]
        right = lookup(right_hash, own_lengths[words] - split)
        both = right >= 0
        words, left, right = words[both], left[both], right[both]
        same_left = (points[words, :split] == points[left, :split]).all(axis=1)
        same_right = (points[words, split:] == points[right, : width - split]).all(axis=1)
        if not (same_left.all() and same_right.all()):
            return None
        found.append((rows[words], ids[rows[left]], ids[rows[right]], np.full(len(words), split)))
    return found
