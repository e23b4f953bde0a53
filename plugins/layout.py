"""AttentionLayout: how one step's packed tokens map onto requests, for the attention ops.

The runtime derives it from the step contract (query_lens, seq_lens, block_tables): requests
with more than one query token take the *context* path, one-token requests the *decode* path.

    packed rows:  [ ctx A: a0 a1 a2 a3 | ctx B: b0 b1 | dec C | dec D | dec E ]
    context_query_rows   [[0, 1, 2, 3],          one row per context request, padded by
                          [4, 5, 5, 5]]          repeating its last row (written twice, same value)
    context_block_tables [[.. A's blocks ..], [.. B's blocks ..]]
    decode_query_rows    [6, 7, 8]
    decode_block_tables  [[C's], [D's], [E's]]   decode_seq_lens [len C, len D, len E]

Every tensor's dimensions are independent (no slicing by another tensor's size), so one
exported graph serves any mix, including steps with no context or no decode requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    context_query_rows: torch.Tensor  # [Bc, Q] int64
    context_block_tables: torch.Tensor  # [Bc, Mc] int64
    decode_query_rows: torch.Tensor  # [Bd] int64
    decode_block_tables: torch.Tensor  # [Bd, Md] int64
    decode_seq_lens: torch.Tensor  # [Bd] int64
    positions: torch.Tensor  # [T] int64, each packed row's position in its request
    # Every row as the kernel's per-row items, context rows first, each with its request's block
    # table and its own length (a context row attends up to its position): made here, once a step,
    # so a layer's attention is one gather, one kernel call and one scatter. Two calls a layer
    # (context, decode) were nine exported nodes, 270 of SmolLM2's 1,747 (#39: the compile's
    # re-trace, lowering and wrapper grow with nodes). The tables are padded to one width,
    # Mc + Md (no symbolic max); the kernel reads a row's first ceil(length / block_size) entries.
    kernel_rows: torch.Tensor = field(init=False)  # [Bc * Q + Bd] int64
    kernel_row_tables: torch.Tensor = field(init=False)  # [Bc * Q + Bd, Mc + Md] int64
    kernel_seq_lens: torch.Tensor = field(init=False)  # [Bc * Q + Bd] int64

    def __post_init__(self) -> None:
        queries_per_request = self.context_query_rows.shape[1]
        context_width, decode_width = self.context_block_tables.shape[1], self.decode_block_tables.shape[1]
        context_rows = self.context_query_rows.flatten()
        context_tables = self.context_block_tables[:, None, :].expand(-1, queries_per_request, -1).flatten(0, 1)
        tables = torch.cat(
            [
                torch.nn.functional.pad(context_tables, (0, decode_width)),
                torch.nn.functional.pad(self.decode_block_tables, (0, context_width)),
            ]
        )
        seq_lens = torch.cat([self.positions[context_rows] + 1, self.decode_seq_lens])
        object.__setattr__(self, "kernel_rows", torch.cat([context_rows, self.decode_query_rows]))
        object.__setattr__(self, "kernel_row_tables", tables)
        object.__setattr__(self, "kernel_seq_lens", seq_lens)
