"""The bounds a step's inputs must keep to the engine's limits, checked before the compiled step.

The compiled step indexes the KV pool and the embedding with these tensors unchecked in its hot
loops; an id past the pool aborts the whole process from an inductor worker thread (a C++
`terminate`, seen when bench/step.py asked a 448-block engine for 32 rows of 17 blocks), taking
every other request with it. The scheduler never builds such inputs, but `Engine.step` is public
(benchmarks, calibration, the draft engine), so an index outside the engine is a ValueError
naming the limit.
The nine checks (18 small reductions) cost 37 us a step, measured on this Zen 4 for 1 and 16 decode
rows: 0.15% of a 1B decode step.
"""

from __future__ import annotations

from ifb.runtime.engine_format import EngineLimits
from ifb.runtime.step.step_inputs import StepInputs


def check_step_inputs(inputs: StepInputs, limits: EngineLimits, vocab_size: int) -> None:
    """Raises ValueError naming the limit a step's inputs exceed. (A step longer than
    max_num_tokens is the scheduler's limit, not the compiled step's: it runs, and reference
    loops in the tests prefill whole prompts that way.)"""
    bounded = (
        ("input_ids", inputs.input_ids, vocab_size, "vocab_size"),
        ("positions", inputs.positions, limits.max_seq_len, "max_seq_len"),
        (
            "slot_mapping",
            inputs.slot_mapping,
            limits.kv_pool_tokens,
            "the KV pool's slots (num_kv_blocks * block_size)",
        ),
        ("context_block_tables", inputs.context_block_tables, limits.num_kv_blocks, "num_kv_blocks"),
        ("decode_block_tables", inputs.decode_block_tables, limits.num_kv_blocks, "num_kv_blocks"),
        ("decode_seq_lens", inputs.decode_seq_lens - 1, limits.max_seq_len, "max_seq_len"),
        ("context_query_rows", inputs.context_query_rows, inputs.num_tokens, "the step's token count"),
        ("decode_query_rows", inputs.decode_query_rows, inputs.num_tokens, "the step's token count"),
        ("logits_indices", inputs.logits_indices, inputs.num_tokens, "the step's token count"),
    )
    for field, tensor, bound, limit in bounded:
        if not tensor.numel():
            continue
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= bound:
            raise ValueError(f"step input {field} holds {low if low < 0 else high}, outside [0, {bound}): {limit}")
