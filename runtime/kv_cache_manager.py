"""KVCacheManager: the block pool over the engine's KV slots, with hash-chain prefix reuse.

    pool:  [ b0 b1 b2 ... b(N-1) ]     each block holds block_size tokens of every layer's K/V
    free:  LRU order, head evicted first; holds never-used blocks and cached blocks nobody
           references (ref_count == 0), which stay reusable until evicted
    cached: sha256(parent key, salt, block's tokens) -> block_id (prefix_hash.py), for full, computed blocks

A request's block_ids is its block table. Blocks are released tail-first so that the end of a
prompt is evicted before its shared beginning. A request keeps every block until it finishes;
with a window on every layer, windowed_kv_cache_manager.py frees those that slid out of it.

A BlockTier (prefix_disk_tier.py) extends the cache: an evicted cached block is spilled to it, and
a prefix match brings back the chain's blocks it holds as cached blocks before matching.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from ifb.runtime.engine_snapshot import DiskTierUsage
from ifb.runtime.prefix_hash import ROOT_KEY, prefix_block_keys
from ifb.runtime.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockTier(Protocol):
    """A second home for cached blocks evicted from the pool, keyed by their prefix hash."""

    def contains(self, block_hash: bytes) -> bool: ...

    def spill(self, block_hash: bytes, block_id: int, wait: bool = False) -> None:
        """Keep a copy of the block, read now (before it is reused); never blocks unless `wait`."""

    def restore(self, block_hash: bytes, block_id: int) -> bool:
        """Fill the pool block with the stored one; False if it has none (or a bad one)."""

    def count_misses(self, num_blocks: int) -> None: ...

    def usage(self) -> DiskTierUsage: ...

    def close(self) -> None: ...


class _NoTier:
    """No tier: evicted blocks are gone."""

    def contains(self, block_hash: bytes) -> bool:
        return False

    def spill(self, block_hash: bytes, block_id: int, wait: bool = False) -> None:
        return None

    def restore(self, block_hash: bytes, block_id: int) -> bool:
        return False

    def count_misses(self, num_blocks: int) -> None:
        return None

    def usage(self) -> DiskTierUsage:
        return DiskTierUsage()

    def close(self) -> None:
        return None


NO_TIER: BlockTier = _NoTier()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.tier: BlockTier = NO_TIER

    def attach_tier(self, tier: BlockTier) -> None:
        """Set once the engine's pool exists (on the executor thread, before any step)."""
        self.tier = tier

    # -- the vocabulary the capacity policies use --------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def blocks_needed_for_step(self, request: Request, num_new_tokens: int) -> int:
        total = self.blocks_for_tokens(request.num_computed_tokens + num_new_tokens)
        return max(0, total - len(request.block_ids))

    def blocks_needed_to_completion(self, request: Request) -> int:
        return max(0, self.blocks_for_tokens(request.max_total_tokens) - len(request.block_ids))

    def blocks_needed_to_admit(self, request: Request, prefix_block_ids: list[int]) -> int:
        """Blocks a waiting request takes from the free list to completion: prefix hits another
        request holds cost nothing (neither lets go of them before finishing)."""
        total = self.blocks_for_tokens(request.max_total_tokens)
        return total - len(prefix_block_ids) + self.num_free_among(prefix_block_ids)

    # -- prefix reuse -------------------------------------------------------------------------
    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        chain = request.block_hashes
        if len(chain) < num_full_blocks:
            parent = chain[-1] if chain else ROOT_KEY
            salt = request.params.cache_salt
            chain += prefix_block_keys(request.token_ids, self.block_size, salt, len(chain), parent, num_full_blocks)
        return chain[:num_full_blocks]

    def match_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least one token to compute."""
        if not self.enable_prefix_reuse:
            return []
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        self._restore(hashes)
        return self._longest_cached(hashes)

    def _longest_cached(self, hashes: list[bytes]) -> list[int]:
        hits: list[int] = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _restore(self, hashes: list[bytes]) -> None:
        """Bring back from the tier the chain's blocks the pool lost, as cached blocks nobody
        references, up to the first one neither holds. A restore takes the free list's head, so
        the chain's blocks in RAM move to its tail first and are never the ones evicted."""
        missing = [h for h in hashes if h not in self._cached]
        if not missing or not self.tier.contains(missing[0]):
            return
        self._touch(hashes)
        room = len(self._free) - sum(1 for h in hashes if self._cached.get(h) in self._free)
        for block_hash in missing[:room]:
            if not self._restore_block(block_hash):
                break
        self._touch(hashes)

    def _touch(self, hashes: list[bytes]) -> None:
        """The chain's free cached blocks to the free list's tail, its beginning last (as `free`)."""
        for block_hash in reversed(hashes):
            block_id = self._cached.get(block_hash)
            if block_id is not None and block_id in self._free:
                self._free.move_to_end(block_id)

    def _restore_block(self, block_hash: bytes) -> bool:
        block_id = self._pop_free()
        block = self.blocks[block_id]
        block.ref_count = 0
        self._free[block_id] = None
        if not self.tier.restore(block_hash, block_id):
            self._free.move_to_end(block_id, last=False)  # empty: the next one handed out
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of these (prefix-hit) blocks sit in the free list and would leave it."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def admit(self, request: Request, prefix_block_ids: list[int]) -> None:
        """Give a (re)admitted request its prefix hits; computation resumes after them."""
        for block_id in prefix_block_ids:
            self._take(block_id)
        request.block_ids = list(prefix_block_ids)
        hit_tokens = len(prefix_block_ids) * self.block_size
        request.num_computed_tokens = hit_tokens
        request.num_prefix_hit_tokens = hit_tokens
        request.num_published_blocks = len(prefix_block_ids)
        self.prefix_queried_tokens += request.num_tokens
        self.prefix_hit_tokens += hit_tokens
        if self.enable_prefix_reuse:
            self.tier.count_misses((request.num_tokens - 1) // self.block_size - len(prefix_block_ids))

    def publish(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_reuse:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        done = request.num_published_blocks
        if full <= done:
            return
        hashes = self._block_hashes(request, full)
        for index in range(done, full):
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is None and hashes[index] not in self._cached:
                block.block_hash = hashes[index]
                self._cached[hashes[index]] = block.block_id
        request.num_published_blocks = full

    def advance(self, request: Request) -> None:
        """After a step advanced the request's num_computed_tokens: publish its newly full blocks."""
        self.publish(request)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table to hold `num_new_tokens` more; False if the pool is short."""
        needed = self.blocks_needed_for_step(request, num_new_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            request.block_ids.append(self._pop_free())
        return True

    def release_beyond(self, request: Request, num_tokens: int) -> None:
        """Give back the tail blocks past the first `num_tokens` tokens' (the slots of rejected
        speculative drafts): private to the request, never published, so straight to the free list."""
        keep = self.blocks_for_tokens(num_tokens)
        while len(request.block_ids) > keep:
            self._release(request.block_ids.pop())

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first); cached ones stay reusable."""
        for block_id in reversed(request.block_ids):
            self._release(block_id)
        request.block_ids = []
        request.num_published_blocks = 0

    def lend(self, num_blocks: int) -> list[int]:
        """Blocks for a step no request owns (calibration in an idle turn: step_budget/idle_calibration.py),
        taken as an allocation would take them; give them back with `take_back` before the next schedule."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot lend {num_blocks} blocks: {len(self._free)} are free")
        return [self._pop_free() for _ in range(num_blocks)]

    def take_back(self, block_ids: Iterable[int]) -> None:
        """Lent blocks return to the free list's head: they hold nothing anyone can reuse, so they
        go before any cached block."""
        for block_id in reversed(list(block_ids)):  # in the order they were lent
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.block_hash is None, f"block {block_id} was not lent"
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def _release(self, block_id: int) -> None:
        """Drop one reference; the last one puts the block at the free list's tail (evicted last)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: least recently used cached block
            self.tier.spill(block.block_hash, block_id)
            del self._cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def close(self) -> None:
        """At shutdown: every cached block goes to the tier, least recently used first (so the
        tier's own LRU keeps the hottest), waiting for the writer; then the tier closes."""
        order = [*self._free, *(b.block_id for b in self.blocks if b.ref_count > 0)]
        for block_id in order:
            block_hash = self.blocks[block_id].block_hash
            if block_hash is not None:
                self.tier.spill(block_hash, block_id, wait=True)
        self.tier.close()

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """free + used == total; ref counts equal the live block tables' references."""
        expected = Counter(block_id for request in live_requests for block_id in request.block_ids)
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            assert block.ref_count == expected[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {expected[block.block_id]} references"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id} free-list mismatch"
            )
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + len(self._free) == self.num_blocks, "free + used != total"
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"cached block {block_id} hash mismatch"
