"""Fast paged attention and KV write: vectorized gathers + SDPA, exportable with dynamic shapes.

Same signatures as `attention_reference.py`. Without the kernel library (dense engines) the
context path (requests with several query tokens) runs SDPA with each request's queries padded
to the longest chunk, and the decode path (one query token each) carries no padding at all and
is written so the compiler fuses the gather. With it (block-quantized engines) both paths run
the C++ kernel row by row, so a token's attention never depends on the step around it.
The pools may be narrower than the step (`ifb build --kv-dtype fp16`, or q8_0 rows of int8 and
per-32 scales, `kv_format.py`): K/V are rounded to the pool's format when written and read back
in fp32 (the torch paths dequantize the blocks they gather, the kernel as it loads each row).

Every path takes the layer's `AttentionVariant` (attention_variant.py: the sliding window, the
soft-cap) and its sink logits (gpt-oss) beside it, one contract: SDPA has no hook for a cap or a
sink, so a capped or sunk context path forms its scores explicitly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ifb.plugins.attention_variant import PLAIN, AttentionVariant
from ifb.plugins.casts import cast
from ifb.plugins.kv_format import decode, encode
from ifb.plugins.layout import AttentionLayout


def write_kv(
    k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store each token's K/V at its slot, in place, in the pools' format. Pools are
    [num_slots, kv_heads, row] (row = head_dim values, or a q8_0 row of bytes)."""
    k_pool.index_copy_(0, slot_mapping, encode(k_pool, k))
    v_pool.index_copy_(0, slot_mapping, encode(v_pool, v))


def _gather_blocks(pool: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, KVH, row] x [N, M] -> values [N, M * block_size, KVH, head_dim] (q8_0 dequantized)."""
    blocks = pool.reshape(-1, block_size, pool.shape[1], pool.shape[2])
    gathered = blocks[block_tables]
    length = block_tables.shape[1] * block_size
    return decode(gathered.reshape(block_tables.shape[0], length, pool.shape[1], pool.shape[2]))


def _grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Q, H, D], keys/values [N, L, KVH, D], mask [N, Q, L] -> [N, Q, H, D].

    Query heads sharing a KV head are folded into the query axis, so K/V are never repeated.
    K/V stored narrower than q (an fp16 pool under fp32 or bf16 compute) are read in fp32, and
    q with them: SDPA takes one dtype, and rounding K/V to bf16 would drop bits fp16 kept.
    """
    if keys.dtype != q.dtype:
        return _grouped_attention(q.float(), keys.float(), values.float(), mask, scale, softcap, sinks).to(q.dtype)
    n, num_q, num_heads, head_dim = q.shape
    num_kv_heads, length = keys.shape[2], keys.shape[1]
    group = num_heads // num_kv_heads
    qg = q.reshape(n, num_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(n, num_kv_heads, group * num_q, head_dim)
    grouped_mask = mask[:, None, None].expand(n, 1, group, num_q, length)
    grouped_mask = grouped_mask.reshape(n, 1, group * num_q, length)
    if softcap is None and sinks is None:
        out = F.scaled_dot_product_attention(
            qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=grouped_mask, scale=scale
        )
    else:
        # each folded query row's sink: head (kv, g) repeated over the num_q queries
        row_sinks = None
        if sinks is not None:
            row_sinks = sinks.reshape(num_kv_heads, group, 1).expand(-1, -1, num_q).reshape(num_kv_heads, -1)
        out = _explicit_attention(
            qg, keys.transpose(1, 2), values.transpose(1, 2), grouped_mask, scale, softcap, row_sinks
        )
    out = out.reshape(n, num_kv_heads, group, num_q, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(n, num_q, num_heads, head_dim)


def _explicit_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    row_sinks: torch.Tensor | None,
) -> torch.Tensor:
    """SDPA's arithmetic spelled out, with the scores capped before the mask and each row's sink
    joining its softmax: q [N, KVH, R, D], keys/values [N, KVH, L, D], mask [N, 1, R, L],
    row_sinks [KVH, R] -> [N, KVH, R, D]."""
    scores = _cap(torch.matmul(q, keys.transpose(-1, -2)) * scale, softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if row_sinks is None:
        return torch.matmul(scores.softmax(dim=-1), values)
    probs = _softmax_with_sink(scores.float(), row_sinks.float()[None, :, :, None], dim=-1)
    return torch.matmul(probs.to(values.dtype), values)


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax over `scores` and one more logit `sink` (broadcast to scores with `dim` of size 1),
    the sink's own probability dropped: it weights no value (transformers' GptOss attention)."""
    top = torch.maximum(scores.amax(dim=dim, keepdim=True), sink)
    weights = (scores - top).exp()
    return weights / (weights.sum(dim=dim, keepdim=True) + (sink - top).exp())


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, H, D], keys/values [N, L, KVH, D] (gathered lazily), mask [N, L] -> [N, H, D].

    Written as elementwise products and sums rather than SDPA on purpose: the compiler fuses
    the block gather into these reductions, so K/V are read once from the pool instead of
    being copied out first (the copy was a third of a batch-32 decode step).
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    qg = q.reshape(n, 1, num_kv_heads, group, head_dim).float()
    scores = _cap((qg * keys.float()[:, :, :, None, :]).sum(-1) * scale, softcap)  # [N, L, KVH, G]
    scores = scores.masked_fill(~mask[:, :, None, None], float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=1)
    else:
        probs = _softmax_with_sink(scores, sinks.float().reshape(1, 1, num_kv_heads, group), dim=1)
    out = (probs[..., None] * values.float()[:, :, :, None, :]).sum(1)  # [N, KVH, G, D]
    return out.reshape(n, num_heads, head_dim).to(q.dtype)


def _context_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    positions: torch.Tensor,
    layout: AttentionLayout,
    block_size: int,
    scale: float,
    variant: AttentionVariant,
    sinks: torch.Tensor | None,
) -> None:
    rows = layout.context_query_rows
    keys = _gather_blocks(k_pool, layout.context_block_tables, block_size)
    values = _gather_blocks(v_pool, layout.context_block_tables, block_size)
    key_index = torch.arange(keys.shape[1], device=q.device)
    query_positions = positions[rows][:, :, None]
    mask = key_index[None, None, :] <= query_positions
    if variant.window is not None:
        mask = mask & (key_index[None, None, :] > query_positions - variant.window)
    context_out = _grouped_attention(q[rows], keys, values, mask, scale, variant.softcap, sinks)
    out.index_copy_(0, rows.flatten(), context_out.flatten(0, 1))


def _kernel_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    variant: AttentionVariant,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel's one op, the variant as its named fields (sinks in fp32, as the kernel reads them)."""
    return torch.ops.ifb_quant.paged_attention(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        block_size,
        scale,
        variant.kernel_fields(),
        None if sinks is None else cast(sinks, torch.float32),
    )


def paged_attention(
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
    (its last `window` keys only; scores capped), with `sinks` [H] in each softmax if given.

    q [T, H, D]; pools [num_slots, KVH, row]; returns [T, H, D].
    """
    out = torch.zeros_like(q)
    _context_attention(out, q, k_pool, v_pool, positions, layout, block_size, scale, variant, sinks)
    rows = layout.decode_query_rows
    keys = _gather_blocks(k_pool, layout.decode_block_tables, block_size)
    values = _gather_blocks(v_pool, layout.decode_block_tables, block_size)
    key_index = torch.arange(keys.shape[1], device=q.device)
    seq_lens = layout.decode_seq_lens[:, None]
    mask = key_index[None, :] < seq_lens
    if variant.window is not None:
        mask = mask & (key_index[None, :] >= seq_lens - variant.window)
    out.index_copy_(0, rows, _decode_attention(q[rows], keys, values, mask, scale, variant.softcap, sinks))
    return out


def paged_attention_decode_kernel(
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
    """`paged_attention` in our C++ kernel (plugins/csrc/paged_decode_attention.cpp), which reads
    each request's K/V in place through its block table: at 32 rows x 256 tokens of context it
    took the SmolLM2 int8 step from 55 to 42 ms (the compiled gather-and-reduce read K/V at a
    quarter of the memory bandwidth; `bench/decode_attention.py`). Needs the engine's kernel
    library loaded. Context and decode rows go through it in one call (`layout.kernel_rows`),
    each row over its request's keys up to its own position (`positions` is in the layout).

    Why not SDPA for the context rows: its CPU kernels split queries and keys into blocks sized by
    the padded chunk and context lengths, and the GEMMs inside sum in an order that follows those
    sizes, so a prompt's logits moved in the last bits with its chunking and with prefix reuse
    (SmolLM2: 9 of 20 two-chunk splits of one prompt, up to 6.3e-5 in a logit; a reused chat
    prefix moved 2 of 8 first-token logprobs). Row by row in the kernel's one fixed order, a
    token's attention is the same whether it is prefilled whole, in chunks, after a reused prefix,
    or decoded. The kernel tiles a request's rows (they share its block table) over shared K/V
    loads, each row still in decode's order: a 448-token chunk over 1,536 cached tokens read its
    keys ~2,000 times a row before (bench/prefill_attention.py). Padded context entries repeat
    their request's last row and are computed twice, same value."""
    rows = layout.kernel_rows
    attended = _kernel_attention(
        cast(q[rows], torch.float32),
        k_pool,
        v_pool,
        layout.kernel_row_tables,
        layout.kernel_seq_lens,
        block_size,
        scale,
        variant,
        sinks,
    )
    out = torch.zeros_like(q)
    out.index_copy_(0, rows, cast(attended, q.dtype))
    return out
