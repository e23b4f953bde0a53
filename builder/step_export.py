"""What torch.export sees of a step: sample arguments and dynamic shapes, both derived from the
runtime's step-input spec (STEP_INPUTS, dimension_bounds), shared by the CPU and ONNX exports."""

from __future__ import annotations

import torch
from torch.export import Dim

from ifb.runtime.engine_format import STEP_INPUTS, EngineLimits, dimension_bounds
from ifb.runtime.step.engine import kv_pool_views
from ifb.runtime.step.step_inputs import StepInputs

# Sample sizes are distinct and >= 2 so export keeps every dimension symbolic.
SAMPLE_SIZES = {
    "num_tokens": 11,
    "num_context": 2,
    "max_chunk_len": 4,
    "context_blocks": 3,
    "num_decode": 5,
    "decode_blocks": 6,
    "num_logits": 7,
}


def _long(values: list[int] | list[list[int]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def sample_step_inputs(limits: EngineLimits) -> StepInputs:
    """A mixed step: two context chunks (4 and 2 tokens, padded) and five decodes."""
    bs, num_decode = limits.block_size, SAMPLE_SIZES["num_decode"]
    return StepInputs(
        input_ids=torch.zeros(SAMPLE_SIZES["num_tokens"], dtype=torch.long),
        positions=_long([0, 1, 2, 3, bs, bs + 1] + [bs * 2 + i for i in range(num_decode)]),
        slot_mapping=_long(list(range(SAMPLE_SIZES["num_tokens"]))),
        context_query_rows=_long([[0, 1, 2, 3], [4, 5, 5, 5]]),
        context_block_tables=torch.zeros(SAMPLE_SIZES["num_context"], SAMPLE_SIZES["context_blocks"], dtype=torch.long),
        decode_query_rows=_long(list(range(6, 6 + num_decode))),
        decode_block_tables=torch.zeros(num_decode, SAMPLE_SIZES["decode_blocks"], dtype=torch.long),
        decode_seq_lens=_long([bs * 2 + i + 1 for i in range(num_decode)]),
        logits_indices=_long([3, 5, 6, 7, 8, 9, 10]),
    )


def sample_args(limits: EngineLimits, kv_cache: torch.Tensor) -> tuple[object, ...]:
    """The network's positional arguments for export: the step inputs, then the pools (views of
    `kv_cache`, whose dtype, the engine's kv_dtype, becomes the compiled step's pool dtype)."""
    return (*sample_step_inputs(limits).as_args(), kv_pool_views(kv_cache))


def dynamic_shapes(limits: EngineLimits, num_pools: int) -> tuple[object, ...]:
    """Every step dimension bounded by a baked limit (never below the sample size)."""
    dims = {
        name: Dim(name, min=low, max=max(high, SAMPLE_SIZES[name]))
        for name, (low, high) in dimension_bounds(limits).items()
    }
    per_input = tuple({axis: dims[dim] for axis, dim in enumerate(tensor.dims)} for tensor in STEP_INPUTS)
    return (*per_input, [None] * num_pools)
