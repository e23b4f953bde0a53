"""The graphs of a layer-chunked step and the names they bind their weights by (#39).

An unrolled step graph holds every decoder layer, so its compile time grows with depth although
the layers run the same code. A chunked engine compiles a run of K alike layers once
(`LayerChunkNetwork`) and loads that one library as one container per run of layers, each bound
to its own layers' weights in the mapped weights file; the head (`HeadNetwork`) is a package of
its own, and the embedding runs eagerly (one op of ours; as a package it cost a fixed ~8 s of
compile). A chunk names its layers `layers.0 .. layers.K-1` whichever layers it runs:
`network_constant_name` maps such a name to the network's (the weights file's) name.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ifb.plugins.layout import AttentionLayout
from ifb.runtime.step.network import LOCAL_ROPE_TABLES, ROPE_TABLES, StepNetwork, head_logits, rotary_rows, run_layers

_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


class LayerChunkNetwork(nn.Module):
    """Decoder layers [first, first + count) of `network`: the step's hidden states and its per-step
    inputs (all but the token ids and logits rows) in, the hidden states after the last layer out."""

    def __init__(self, network: StepNetwork, first: int, count: int) -> None:
        super().__init__()
        self.spec = network.spec
        self.layers = nn.ModuleList(network.layers[first : first + count])
        local = LOCAL_ROPE_TABLES if network.spec.local_rope_theta is not None else ()
        for name in (*ROPE_TABLES, *local):  # the network's own tables, bound by the same names
            self.register_buffer(name, getattr(network, name), persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_query_rows: torch.Tensor,
        context_block_tables: torch.Tensor,
        decode_query_rows: torch.Tensor,
        decode_block_tables: torch.Tensor,
        decode_seq_lens: torch.Tensor,
        kv_pools: list[torch.Tensor],
    ) -> torch.Tensor:
        layout = AttentionLayout(
            context_query_rows, context_block_tables, decode_query_rows, decode_block_tables, decode_seq_lens, positions
        )
        rows = rotary_rows(self, self.spec, positions, x.dtype)
        return run_layers(self.layers, x, rows, positions, slot_mapping, layout, kv_pools)


class HeadNetwork(nn.Module):
    """The final norm and the LM head over the sampling rows: the network's own modules and names."""

    def __init__(self, network: StepNetwork) -> None:
        super().__init__()
        self.spec = network.spec
        self.norm, self.lm_head = network.norm, network.lm_head

    def forward(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return head_logits(self.spec, self.norm, self.lm_head, x, logits_indices)


def network_constant_name(chunk_name: str, first: int) -> str:
    """A chunk package's constant name (its layers counted from 0) -> the network's, for the chunk
    that starts at layer `first`; names outside the layers (the rotary tables) are the network's."""
    match = _LAYER_NAME.fullmatch(chunk_name)
    if match is None:
        return chunk_name
    return f"layers.{first + int(match.group(1))}.{match.group(2)}"
