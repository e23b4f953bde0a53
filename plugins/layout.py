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
    # The context rows as the kernel's per-row items, each with its request's block table: made
    # here, once a step, rather than by every layer's attention (four exported nodes a layer).
    context_rows: torch.Tensor = field(init=False)  # [Bc * Q] int64
    context_row_tables: torch.Tensor = field(init=False)  # [Bc * Q, Mc] int64

    def __post_init__(self) -> None:
        queries_per_request = self.context_query_rows.shape[1]
        tables = self.context_block_tables[:, None, :].expand(-1, queries_per_request, -1).flatten(0, 1)
        object.__setattr__(self, "context_rows", self.context_query_rows.flatten())
        object.__setattr__(self, "context_row_tables", tables)
