"""Prefix-cache keys: a SHA-256 chain over full KV blocks, salted per tenant.

key(block i) = sha256(key(block i-1) || salt || the block's token ids as little-endian int32).
A cryptographic hash, not Python's `hash()` of a tuple: a client who can choose token ids must
not be able to make two different prefixes share a key (the class of flaw behind a 2025 vLLM
advisory), and `cache_salt` keeps one tenant's blocks unreachable from another's prompts.
The same function keys replicas' caches for prefix-affinity routing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_KEY = b"\x00" * 32


def block_key(parent: bytes, token_ids: Sequence[int], salt: str | None) -> bytes:
    digest = hashlib.sha256(parent)
    salt_bytes = (salt or "").encode("utf-8")
    digest.update(struct.pack("<I", len(salt_bytes)) + salt_bytes)
    digest.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return digest.digest()


def prefix_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None,
    start: int = 0,
    parent: bytes = ROOT_KEY,
    num_blocks: int | None = None,
) -> list[bytes]:
    """Keys of the full blocks of `token_ids` from block `start` on (chained from `parent`)."""
    total = len(token_ids) // block_size if num_blocks is None else num_blocks
    keys = []
    for i in range(start, total):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
        keys.append(parent)
    return keys
