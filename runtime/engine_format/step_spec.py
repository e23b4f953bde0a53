"""The step-input contract, declared once: every tensor a step takes, its named dimensions and
their bounds. Export arguments, dynamic shapes, ONNX names, TensorRT profiles and bindings are
all derived from `STEP_INPUTS` and `dimension_bounds` (docs/design.md §3).

    input_ids, positions, slot_mapping      [num_tokens]        prefill chunks first, then decodes
    context_query_rows                      [num_context, max_chunk_len]   packed rows (padded)
    context_block_tables                    [num_context, context_blocks]
    decode_query_rows, decode_seq_lens      [num_decode]
    decode_block_tables                     [num_decode, decode_blocks]
    logits_indices                          [num_logits]        rows that sample
    kv_pools (after these)                  2 x num_layers x [num_slots, kv_heads, head_dim],
                                            in the engine's kv_dtype (engine.json), not its dtype
"""

from __future__ import annotations

from dataclasses import dataclass

from ifb.runtime.engine_format.limits import EngineLimits


@dataclass(frozen=True, slots=True)
class StepTensor:
    """One dynamic step input: its name (= argument, ONNX input, TensorRT binding) and dims."""

    name: str
    dims: tuple[str, ...]


STEP_INPUTS: tuple[StepTensor, ...] = (
    StepTensor("input_ids", ("num_tokens",)),
    StepTensor("positions", ("num_tokens",)),
    StepTensor("slot_mapping", ("num_tokens",)),
    StepTensor("context_query_rows", ("num_context", "max_chunk_len")),
    StepTensor("context_block_tables", ("num_context", "context_blocks")),
    StepTensor("decode_query_rows", ("num_decode",)),
    StepTensor("decode_block_tables", ("num_decode", "decode_blocks")),
    StepTensor("decode_seq_lens", ("num_decode",)),
    StepTensor("logits_indices", ("num_logits",)),
)
STEP_INPUT_NAMES: tuple[str, ...] = tuple(t.name for t in STEP_INPUTS)
KV_POOLS_ARGUMENT = "kv_pools"


def kv_pool_names(num_layers: int) -> list[str]:
    """Names of the per-layer pools as flattened graph inputs: K0, V0, K1, V1, ..."""
    return [f"{KV_POOLS_ARGUMENT}_{i}" for i in range(2 * num_layers)]


def dimension_bounds(limits: EngineLimits) -> dict[str, tuple[int, int]]:
    """The [min, max] of every named step dimension: the baked limits, and nothing else."""
    return {
        "num_tokens": (1, limits.max_num_tokens),
        "num_context": (0, limits.max_batch_size),
        "max_chunk_len": (1, limits.max_num_tokens),
        "context_blocks": (1, limits.max_blocks_per_seq),
        "num_decode": (0, limits.max_batch_size),
        "decode_blocks": (1, limits.max_blocks_per_seq),
        "num_logits": (1, limits.max_batch_size),
    }
