"""ONNX export of the step network: the graph the TensorRT backend builds its plan from.

ONNX has no in-place writes, so the exported graph returns, besides the logits, the K/V rows of
this step's tokens for every layer (`kv_rows_*`, [num_tokens, kv_heads, head_dim]); the runtime
writes them into its pool at `slot_mapping`. Inside the graph attention already sees them.
Dimension bounds (= the baked limits) are recorded as model metadata, `ifb.bounds.<dim>`.

The weights always go to a side file, `<name>.onnx.data`, next to the graph: a protobuf cannot
exceed 2 GB (~1B parameters in fp16), and one layout for every model size means the tiny test
model exercises the same path as a large one. Readers (onnxruntime, TensorRT's
`parse_from_file`) resolve the side file relative to the graph's folder: keep the two together.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ifb.builder.step_export import dynamic_shapes, sample_args
from ifb.runtime.engine_format import STEP_INPUT_NAMES, EngineLimits, dimension_bounds, kv_pool_names
from ifb.runtime.step.network import StepNetwork

# Opset 18: every TensorRT 10.x parser takes opsets 9-20 (10.0's documented range; later 10.x
# and 11.x only widen it), and 18 is the opset torch's dynamo exporter implements its ops in
# (torchlib), so no version converter runs over the graph. Raise it only when the oldest
# TensorRT we support parses the new one.
ONNX_OPSET = 18


def external_data_path(onnx_path: Path) -> Path:
    """Where `export_onnx` puts the weights of the graph at `onnx_path`."""
    return onnx_path.with_name(onnx_path.name + ".data")


class _WithKvRows(nn.Module):
    """The step network, returning the rows it wrote into each pool as extra outputs."""

    def __init__(self, network: StepNetwork) -> None:
        super().__init__()
        self.network = network

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_query_rows: torch.Tensor,
        context_block_tables: torch.Tensor,
        decode_query_rows: torch.Tensor,
        decode_block_tables: torch.Tensor,
        decode_seq_lens: torch.Tensor,
        logits_indices: torch.Tensor,
        kv_pools: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        logits = self.network(
            input_ids,
            positions,
            slot_mapping,
            context_query_rows,
            context_block_tables,
            decode_query_rows,
            decode_block_tables,
            decode_seq_lens,
            logits_indices,
            kv_pools,
        )
        return (logits, *[pool[slot_mapping] for pool in kv_pools])


def export_onnx(network: StepNetwork, limits: EngineLimits, kv_cache: torch.Tensor, path: Path) -> Path:
    """Export `network` with the step contract's dynamic dimensions to `path`, its weights to
    `external_data_path(path)` beside it."""
    wrapper = _WithKvRows(network).eval()
    num_pools = 2 * kv_cache.shape[0]
    with torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            sample_args(limits, kv_cache),
            input_names=[*STEP_INPUT_NAMES, *kv_pool_names(num_pools // 2)],
            output_names=["logits", *[f"kv_rows_{i}" for i in range(num_pools)]],
            opset_version=ONNX_OPSET,
            dynamic_shapes=dynamic_shapes(limits, num_pools),
            dynamo=True,
        )
    assert program is not None
    # Metadata goes on the in-memory graph before the one save: re-loading and re-saving with
    # `onnx` would pull every weight back into one protobuf, the 2 GB limit this file avoids.
    for name, (low, high) in dimension_bounds(limits).items():
        program.model.metadata_props[f"ifb.bounds.{name}"] = json.dumps([low, high])
    program.save(str(path), external_data=True)
    return path
