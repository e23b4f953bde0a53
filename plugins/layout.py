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

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    context_query_rows: torch.Tensor  # [Bc, Q] int64
    context_block_tables: torch.Tensor  # [Bc, Mc] int64
    decode_query_rows: torch.Tensor  # [Bd] int64
    decode_block_tables: torch.Tensor  # [Bd, Md] int64
    decode_seq_lens: torch.Tensor  # [Bd] int64
