"""Reference paged attention and KV write: per-request loops, written to be obviously right.

Slow on purpose. The fast ops in `attention.py` have the same signatures and are checked
against these in tests.
"""

from __future__ import annotations

import torch

from ifb.plugins.attention_variant import PLAIN, AttentionVariant
from ifb.plugins.kv_format import decode, encode
from ifb.plugins.layout import AttentionLayout


def write_kv_reference(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store each token's K/V at its slot, rounded to the pools' format (a q8_0 row per head,
    `kv_format.py`). Pools are [num_slots, kv_heads, row]."""
    for row, slot in enumerate(slot_mapping.tolist()):
        k_pool[slot] = encode(k_pool, k[row])
        v_pool[slot] = encode(v_pool, v[row])


def _attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    query_positions: list[int],
    scale: float,
    variant: AttentionVariant,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [n, H, D]; keys/values [L, KVH, D]; query i sees keys 0..query_positions[i], the last
    `window` of them with a sliding window; scores s capped to softcap * tanh(s / softcap); each
    head's sink logit appended to its scores before the softmax and its probability dropped."""
    num_heads, num_kv_heads = q.shape[1], keys.shape[1]
    group = num_heads // num_kv_heads
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float32)
    for i, pos in enumerate(query_positions):
        first = 0 if variant.window is None else max(0, pos + 1 - variant.window)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), keys[first : pos + 1]) * scale
        if variant.softcap is not None:
            scores = torch.tanh(scores / variant.softcap) * variant.softcap
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = torch.softmax(torch.cat((scores, sinks.float()[:, None]), dim=-1), dim=-1)[:, :-1]
        out[i] = torch.einsum("hl,lhd->hd", probs, values[first : pos + 1])
    return out.to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    positions: torch.Tensor,
    layout: AttentionLayout,
    block_size: int,
    scale: float,
    variant: AttentionVariant = PLAIN,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every packed query over its own request's blocks, as `variant` says
    (the last `window` keys of each query's; scores capped), with `sinks` [H] if given.

    q [T, H, D]; pools [num_slots, KVH, row]; returns [T, H, D].
    """
    out = torch.zeros_like(q)

    def context_keys(block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = [int(block_table[p // block_size]) * block_size + p % block_size for p in range(length)]
        index = torch.tensor(slots, dtype=torch.long)
        return decode(k_pool[index]), decode(v_pool[index])

    for r in range(layout.context_query_rows.shape[0]):
        rows = sorted(set(layout.context_query_rows[r].tolist()))
        query_positions = [int(positions[row]) for row in rows]
        keys, values = context_keys(layout.context_block_tables[r], max(query_positions) + 1)
        out[rows] = _attend_one(q[rows], keys, values, query_positions, scale, variant, sinks)
    for d in range(layout.decode_query_rows.shape[0]):
        row = int(layout.decode_query_rows[d])
        length = int(layout.decode_seq_lens[d])
        keys, values = context_keys(layout.decode_block_tables[d], length)
        out[row : row + 1] = _attend_one(q[row : row + 1], keys, values, [length - 1], scale, variant, sinks)
    return out
