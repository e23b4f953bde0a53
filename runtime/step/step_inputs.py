"""StepInputs: one scheduler iteration turned into the flat tensors of the engine step contract.

Context chunks (several query tokens) are packed first, then one token per decoding request
(docs/design.md §3). Logits come back in the order the sampling slices were given, not packed order;
a slice verifying a speculative draft (a chunk of its next token and the drafts) gives one row
per position.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ifb.runtime.engine_format import STEP_INPUT_NAMES


@dataclass(frozen=True, slots=True)
class RequestSlice:
    """What one request contributes to a step."""

    token_ids: Sequence[int]
    start_position: int  # = the request's num_computed_tokens before this step
    block_table: Sequence[int]
    sample: bool  # True for a decode token and for a prompt's last chunk
    num_logits: int = 1  # of a sampling slice: its last rows that sample (1 + drafts, speculation)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The step contract's tensors; field names and order are `STEP_INPUT_NAMES` (tested)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_query_rows: torch.Tensor
    context_block_tables: torch.Tensor
    decode_query_rows: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    logits_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def as_args(self) -> tuple[torch.Tensor, ...]:
        """The tensors in the contract's order: the compiled step's positional inputs."""
        return tuple(getattr(self, name) for name in STEP_INPUT_NAMES)


def _padded(rows: list[list[int]], width: int) -> torch.Tensor:
    if not rows:
        return torch.zeros(0, width, dtype=torch.long)
    return torch.tensor([row + [row[-1]] * (width - len(row)) for row in rows], dtype=torch.long)


def build_step_inputs(slices: Sequence[RequestSlice], block_size: int) -> StepInputs:
    """Pack `slices` into StepInputs; raises ValueError on an empty step or a short block table."""
    if not slices:
        raise ValueError("a step needs at least one request slice")
    context = [s for s in slices if len(s.token_ids) > 1]
    decode = [s for s in slices if len(s.token_ids) == 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: dict[int, list[int]] = {}
    context_rows: list[list[int]] = []
    context_tables: list[list[int]] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    for piece in context + decode:
        end = piece.start_position + len(piece.token_ids)
        num_blocks = math.ceil(end / block_size)
        if len(piece.block_table) < num_blocks:
            raise ValueError(f"block table holds {len(piece.block_table)} blocks, {num_blocks} needed")
        first = len(input_ids)
        input_ids.extend(piece.token_ids)
        for pos in range(piece.start_position, end):
            positions.append(pos)
            slots.append(piece.block_table[pos // block_size] * block_size + pos % block_size)
        rows = list(range(first, len(input_ids)))
        sample_rows[id(piece)] = rows[-piece.num_logits :]
        table = list(piece.block_table[:num_blocks])
        if len(piece.token_ids) > 1:
            context_rows.append(rows)
            context_tables.append(table)
        else:
            decode_rows.append(rows[0])
            decode_tables.append(table)
            decode_lens.append(end)
    chunk = max((len(r) for r in context_rows), default=1)
    context_width = max((len(t) for t in context_tables), default=1)
    decode_width = max((len(t) for t in decode_tables), default=1)
    logits_rows = [row for s in slices if s.sample for row in sample_rows[id(s)]]
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        context_query_rows=_padded(context_rows, chunk),
        context_block_tables=_padded(context_tables, context_width),
        decode_query_rows=torch.tensor(decode_rows, dtype=torch.long),
        decode_block_tables=_padded(decode_tables, decode_width),
        decode_seq_lens=torch.tensor(decode_lens, dtype=torch.long),
        logits_indices=torch.tensor(logits_rows, dtype=torch.long),
    )
