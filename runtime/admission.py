"""Admission: request validation against the engine's limits, and the batch-plus-queue gate."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ifb.runtime.errors import AdmissionError, QueueFullError
from ifb.runtime.windowed_kv_cache_manager import NULL_BLOCKS, SlidingWindowBlocks


def check_prompt(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_seq_len: int,
    max_blocks: int,
    block_size: int,
    window: SlidingWindowBlocks | None = None,
) -> None:
    """Refuse what can never run; names the field and both numbers. With `window` (every layer
    slides) a request holds at most its window's blocks at once, beside the null block."""
    if num_prompt_tokens == 0:
        raise AdmissionError("prompt is empty", field="prompt")
    if num_prompt_tokens >= max_seq_len:
        raise AdmissionError(
            f"prompt has {num_prompt_tokens} tokens; the engine's max_seq_len is {max_seq_len} "
            "(the prompt must leave room for at least one generated token)",
            field="prompt",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_seq_len:
        raise AdmissionError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds the engine's max_seq_len {max_seq_len}",
            field="max_tokens",
        )
    total = num_prompt_tokens + (max_tokens or 1)
    needed = -(-total // block_size)
    if window is not None:
        needed, max_blocks = window.max_blocks_held(total), max_blocks - NULL_BLOCKS
    if needed > max_blocks:
        raise AdmissionError(
            f"prompt + max_tokens = {total} tokens needs more KV blocks than the pool holds ({max_blocks})",
            field="max_tokens",
        )


def unset_max_tokens(
    num_prompt_tokens: int,
    default_max_tokens: int,
    max_seq_len: int,
    max_blocks: int,
    block_size: int,
    window: SlidingWindowBlocks | None = None,
) -> int:
    """The max_tokens of a request that set none (after check_prompt passed): the default, cut
    at max_seq_len and at what the KV pool can hold beside the prompt. Without the pool's cut a
    default longer than the pool passed check_prompt (which counts one token for it) and then
    waited forever under guaranteed_no_evict, which reserves prompt + max_tokens."""
    room = min(default_max_tokens, max_seq_len - num_prompt_tokens)
    usable = max_blocks if window is None else max_blocks - NULL_BLOCKS
    if window is not None and window.max_blocks_held(num_prompt_tokens + room) <= usable:
        return room  # the window bounds what it holds, whatever its length
    return min(room, usable * block_size - num_prompt_tokens)


class AdmissionGate:
    """At most max_batch_size + max_queued_requests requests inside the engine at once."""

    def __init__(self, capacity: int, on_refused: Callable[[], None]) -> None:
        self.capacity = capacity
        self._semaphore = threading.BoundedSemaphore(capacity)
        self._on_refused = on_refused  # the executor counts refusals (one writer of the counters)

    def acquire(self, block: bool = True, timeout: float | None = None, count_refusal: bool = True) -> None:
        if not self._semaphore.acquire(blocking=block, timeout=timeout if block else None):
            if count_refusal:
                self._on_refused()
            raise QueueFullError(
                f"server is full: {self.capacity} requests (max_batch_size + max_queued_requests) are running or queued"
            )

    def release(self) -> None:
        self._semaphore.release()
