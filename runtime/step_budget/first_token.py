"""First-token deadlines: the prefill share a step must grant so that waiting prompts still meet
the time-to-first-token target.

Every prompt before its first token has a deadline, its arrival + `target_ms`. Prompts are served
in order (chunking fcfs), so prompt i has its first token once its own tokens and those of every
prompt ahead of it are computed: the prefill rate that saves it is backlog_i / slack_i tokens per
ms. A step's chunk is the smallest whose corrected predicted rate (chunk / step time) reaches the
highest such rate that is still reachable within `ceiling_ms`; a prompt beyond saving (past its
deadline, or needing more than the ceiling's rate) does not drive it. Goodput counts requests
meeting both targets: a step far past the inter-token target to rescue one late prompt would
break every decoding stream's for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ifb.runtime.step_budget.cost_model import StepCostModel, StepShape

# The default TTFT target: the time the engine needs, alone, to prefill a full batch of typical
# prompts (max_batch_size x DEFAULT_PROMPT_TOKENS in max_num_tokens chunks): no scheduler can give
# the last prompt of a burst a shorter one, so prompts that can still make it are the ones the
# deadlines defend. SmolLM2 int8, 32 seats, 512 tokens per step: 5.7 s (llama-server's TTFT p50
# at 32 clients on the same machine: 21-26 s, bench/README.md).
DEFAULT_TARGET_FULL_BATCH_MULTIPLE = 1.0
DEFAULT_PROMPT_TOKENS = 256
DEFAULT_TARGET_FLOOR_MS = 1000.0  # a tiny engine's prefill is a few ms; a target under a second helps nobody
# A step the deadlines grow may take up to this many times the inter-token target. With the
# default target (2.5x the step's decode time) 1.2 puts a grown step at 3x the decode step, the
# ITL p99 <= 3x p50 goal; at 1.5 the 32-client burst's grown steps took ITL p50 64 -> 91 ms in one
# run, with no TTFT to show for it beyond the noise (bench/README.md).
DEFAULT_CEILING_OVER_ITL_TARGET = 1.2


@dataclass(frozen=True, slots=True)
class PendingPrompt:
    """A prompt the next prefill chunks serve, in serving order: how long it has waited since it
    arrived (None: it had its first token before a preemption; only backlog ahead of others) and
    how many tokens it still has to compute."""

    waited_ms: float | None
    tokens_left: int


@dataclass(frozen=True, slots=True)
class FirstTokenDeadlines:
    target_ms: float
    ceiling_over_itl_target: float = DEFAULT_CEILING_OVER_ITL_TARGET

    def required_rate(self, pending: Sequence[PendingPrompt], max_rate: float) -> float:
        """Prefill tokens per ms that lets every prompt savable at `max_rate` meet its deadline
        (0: none needs more than nothing)."""
        backlog = 0
        rate = 0.0
        for prompt in pending:
            backlog += prompt.tokens_left
            if prompt.waited_ms is None:
                continue
            slack = self.target_ms - prompt.waited_ms
            if slack <= 0:
                continue  # already late: no rate saves it
            needed = backlog / slack
            if needed <= max_rate:
                rate = max(rate, needed)
        return rate

    def chunk(
        self,
        cost_model: StepCostModel,
        correction: float,
        decode: StepShape,
        prefill_start: int,
        pending: Sequence[PendingPrompt],
        itl_chunk: int,
        itl_target_ms: float,
    ) -> int:
        """The prefill chunk the deadlines need beside `decode`: `itl_chunk` (what the inter-token
        target allows) if that rate suffices, else the smallest chunk up to the ceiling that does."""

        def rate(chunk: int) -> float:  # tokens per wall ms of a step with this chunk
            pairs = StepShape.prefill_pairs(prefill_start, chunk)
            shape = StepShape(chunk, decode.num_decode_rows, decode.num_decode_context_tokens, pairs)
            return chunk / (correction * cost_model.predict_ms(shape))

        ceiling_chunk = cost_model.max_prefill_tokens(
            self.ceiling_over_itl_target * itl_target_ms / correction, decode, prefill_start
        )
        if ceiling_chunk <= itl_chunk:
            return itl_chunk
        needed = self.required_rate(pending, rate(ceiling_chunk))
        if needed <= rate(itl_chunk):
            return itl_chunk
        low, high = itl_chunk, ceiling_chunk  # rate(low) < needed <= rate(high)
        while high - low > 1:
            middle = (low + high) // 2
            if rate(middle) >= needed:
                high = middle
            else:
                low = middle
        return high


def default_ttft_target_ms(cost_model: StepCostModel, max_batch_size: int, max_num_tokens: int) -> float:
    """DEFAULT_TARGET_FULL_BATCH_MULTIPLE x the predicted time to prefill max_batch_size prompts of
    DEFAULT_PROMPT_TOKENS alone, in max_num_tokens chunks, at least DEFAULT_TARGET_FLOOR_MS."""
    tokens_left = max_batch_size * DEFAULT_PROMPT_TOKENS
    total_ms = 0.0
    while tokens_left > 0:
        chunk = min(max_num_tokens, tokens_left)
        # Chunks pack whole prompts and prompt pieces; each piece attends within its prompt.
        pieces = StepShape.prefill_pairs(0, DEFAULT_PROMPT_TOKENS) * chunk // DEFAULT_PROMPT_TOKENS
        total_ms += cost_model.predict_ms(StepShape(num_prefill_tokens=chunk, num_prefill_pairs=pieces))
        tokens_left -= chunk
    return round(max(DEFAULT_TARGET_FLOOR_MS, DEFAULT_TARGET_FULL_BATCH_MULTIPLE * total_ms), 0)
