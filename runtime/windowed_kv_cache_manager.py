"""WindowedKVCacheManager: gives back the KV blocks that slid out of an every-layer sliding window.

With a window w on every layer (Mistral 7B v0.1: 4096, Phi-3 4k: 2047) a query at position i
reads the keys at positions p with i - w < p <= i (plugins/attention.py). Once a request has
computed n tokens its next query is at n or later, so the keys at p <= n - w are never read
again, and a block whose last position is <= n - w is dead:

    positions   0 .. 15 | 16 .. 31 | 32 .. 47 | 48 .. 63      block 16, window 24, n = 60
    table     [ null      null       b7         b2      ]    live keys: 37 .. 59
                ^^^^^^^^^^^^^^^^^^^ dead: last position <= 60 - 24 = 36, given back

The table stays position-aligned (the attention reads table[position // block_size]), so a
dead entry is replaced by the null block, as vLLM does: one block of the pool, reserved, never
handed out, never written, never freed. The C++ decode kernel never reads it (it starts at the
window); the torch path gathers every entry and masks it out, so it need only be finite (the
pool reads as zeros where never written). A dead block that was published to the prefix cache
stays cached like any released block, until LRU eviction.

Only a model whose every layer slides frees anything: an interleaved one (Gemma 3, Qwen's
layer_types) keeps every block, because its global layers read them all. A pool per layer kind
(vLLM's hybrid manager) would let its local layers hold only the window, saving
(1 - global layers / layers) of a long request's KV; out of scope here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ifb.runtime.kv_cache_manager import KVCacheManager
from ifb.runtime.request import Request

if TYPE_CHECKING:
    from ifb.runtime.engine_format.model_spec import ModelSpec

# The pool blocks freeing costs: the null block that stands in for every dead table entry.
NULL_BLOCKS = 1


@dataclass(frozen=True, slots=True)
class SlidingWindowBlocks:
    """The block arithmetic of a window every layer shares."""

    window: int
    block_size: int
    max_num_tokens: int  # the most tokens one request computes in a step (its largest chunk)

    @classmethod
    def for_model(
        cls, spec: ModelSpec, block_size: int, max_seq_len: int, max_num_tokens: int
    ) -> SlidingWindowBlocks | None:
        """The window when every layer slides and a sequence can outgrow it; None otherwise
        (nothing to free, so no null block is reserved)."""
        window = spec.sliding_window
        if window is None or spec.full_attention_layers or window >= max_seq_len:
            return None
        return cls(window, block_size, max_num_tokens)

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no later query reads: those whose last position (b + 1) * block_size - 1
        is <= num_computed_tokens - window."""
        return max(0, (num_computed_tokens - self.window + 1) // self.block_size)

    def max_blocks_held(self, num_total_tokens: int) -> int:
        """The most blocks a request of `num_total_tokens` holds at once. In a step computing c
        tokens from n, it holds blocks floor((n - w + 1) / bs) .. ceil((n + c) / bs) - 1: keys
        spanning c + w - 1 positions, at most ceil((c + w - 1) / bs) + 1 blocks, and c is at most
        max_num_tokens."""
        windowed = math.ceil((self.max_num_tokens + self.window - 1) / self.block_size) + 1
        return min(math.ceil(num_total_tokens / self.block_size), windowed)


class WindowedKVCacheManager(KVCacheManager):
    """A KVCacheManager that frees each request's dead blocks as it advances (module docstring).

    The last block id of the pool is the null block: `num_blocks` and `blocks` cover the others,
    so the KV-usage gauge and the capacity policies see only blocks a request can hold.
    """

    def __init__(self, num_blocks: int, window: SlidingWindowBlocks, enable_prefix_reuse: bool = True) -> None:
        super().__init__(num_blocks - NULL_BLOCKS, window.block_size, enable_prefix_reuse)
        self.window = window
        self.null_block_id = num_blocks - 1

    # -- capacity -----------------------------------------------------------------------------
    # GuaranteedNoEvict admits while sum(needed to completion) + the newcomer's need <= free. With
    # freeing, a request's need is its peak (max_blocks_held), not its length: that is what lets
    # more long requests run at once. The plain manager credits a prefix hit held by another
    # request as free, since neither lets go of it before finishing; here a holder drops a shared
    # block when it slides out, which frees nothing while the other still holds it, and that
    # request may then allocate up to its own peak. So nothing shared is credited: a request's
    # remaining need is its peak minus the blocks it alone holds, and a newcomer needs its whole
    # peak. Then sum(peaks) <= usable blocks holds while requests run, and each can always grow
    # to its peak (held blocks <= sum of live ones <= sum of peaks): no request is ever stuck.
    def blocks_needed_to_completion(self, request: Request) -> int:
        live = request.block_ids[self.window.num_dead_blocks(request.num_computed_tokens) :]
        own = sum(1 for b in live if b != self.null_block_id and self.blocks[b].ref_count == 1)
        return max(0, self.window.max_blocks_held(request.max_total_tokens) - own)

    def blocks_needed_to_admit(self, request: Request, prefix_block_ids: list[int]) -> int:
        return self.window.max_blocks_held(request.max_total_tokens)

    # -- prefix reuse -------------------------------------------------------------------------
    def _longest_cached(self, hashes: list[bytes]) -> list[int]:
        """The longest cached prefix whose live blocks are cached; its dead entries are the null
        block. A hit of h blocks is read from block num_dead_blocks(h * block_size) on, so the
        blocks before need not be cached, and under pressure they are the first to go: a request
        gives its dead blocks back as it goes, so the LRU evicts a long prompt's beginning first,
        and matching from block 0 lost the whole hit with it (vLLM matches sliding-window
        prefixes from the right for the same reason)."""
        cached = [self._cached.get(block_hash) for block_hash in hashes]
        run = 0  # cached blocks in a row ending at cached[end - 1]
        best: list[int] = []
        for end, block_id in enumerate(cached, start=1):
            run = run + 1 if block_id is not None else 0
            dead = self.window.num_dead_blocks(end * self.block_size)
            if run >= end - dead:
                best = [self.null_block_id] * dead + [b for b in cached[dead:end] if b is not None]
        return best

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        return super().num_free_among(b for b in block_ids if b != self.null_block_id)

    # -- freeing ------------------------------------------------------------------------------
    def admit(self, request: Request, prefix_block_ids: list[int]) -> None:
        """A long prefix hit may start past the window: its dead blocks go straight back."""
        super().admit(request, prefix_block_ids)
        self._release_slid_out(request)

    def advance(self, request: Request) -> None:
        """Publish first, so a dead block leaves as a cached one (never as an unpublished hole)."""
        super().advance(request)
        self._release_slid_out(request)

    def _release_slid_out(self, request: Request) -> None:
        """Swap the request's dead blocks for the null block. Dead entries form a prefix and the
        earlier ones are holes already, so this walks back from the last dead one to the last
        hole: tail first, so the LRU evicts a prompt's beginning last, as `free` does."""
        table = request.block_ids
        index = self.window.num_dead_blocks(request.num_computed_tokens) - 1
        while index >= 0 and table[index] != self.null_block_id:
            self._release(table[index])
            table[index] = self.null_block_id
            index -= 1

    def _release(self, block_id: int) -> None:
        if block_id != self.null_block_id:  # the null block is nobody's: never counted or freed
            super()._release(block_id)

    def _take(self, block_id: int) -> None:
        if block_id != self.null_block_id:  # a prefix hit's dead entries (match_prefix)
            super()._take(block_id)

    # -- invariants ---------------------------------------------------------------------------
    def check_integrity(self, live_requests: Iterable[Request]) -> None:
        """The plain checks (the null block has no record, so its references count nowhere);
        then: each table's holes are exactly its dead blocks, and were published first."""
        live = list(live_requests)
        super().check_integrity(live)
        assert self.null_block_id not in self._free, "the null block is in the free list"
        assert self.null_block_id not in self._cached.values(), "the null block is in the prefix cache"
        for request in live:
            dead = self.window.num_dead_blocks(request.num_computed_tokens)
            table = request.block_ids
            assert all(b == self.null_block_id for b in table[:dead]), f"{request.request_id}: a dead block is held"
            assert self.null_block_id not in table[dead:], f"{request.request_id}: a live block is a hole"
            assert not self.enable_prefix_reuse or dead <= request.num_published_blocks, (
                f"{request.request_id}: a block was freed unpublished"
            )


def make_kv_cache_manager(
    num_blocks: int, block_size: int, enable_prefix_reuse: bool, window: SlidingWindowBlocks | None
) -> KVCacheManager:
    """The one place that chooses: freeing slid-out blocks only for a window on every layer."""
    if window is None:
        return KVCacheManager(num_blocks, block_size, enable_prefix_reuse)
    return WindowedKVCacheManager(num_blocks, window, enable_prefix_reuse)
