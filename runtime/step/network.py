"""Our own Llama-family network over one packed, padding-free step of many requests.

One forward = one scheduler iteration (docs/design.md §3): prefill chunks and decode tokens of many
requests, K/V written into the paged pool through `slot_mapping`, attention over each
request's blocks, logits only for the rows that sample. Fused q/k/v and gate/up projections
keep the number of matmuls per layer at four.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ifb.plugins.attention import paged_attention, paged_attention_decode_kernel, write_kv
from ifb.plugins.attention_reference import paged_attention_reference, write_kv_reference
from ifb.plugins.attention_variant import AttentionVariant
from ifb.plugins.casts import cast
from ifb.plugins.layout import AttentionLayout
from ifb.plugins.quant_formats import WeightCompute, WeightFormat
from ifb.runtime.engine_format import Activation, ModelSpec
from ifb.runtime.step.moe_block import MoeBlock, expert_shapes
from ifb.runtime.step.quant_embedding import QuantEmbedding
from ifb.runtime.step.quant_linear import QuantLinear
from ifb.runtime.step.segmented_linear import SegmentedLinear, part_formats, segments


@dataclass(frozen=True, slots=True)
class AttentionOps:
    attend: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]


FAST_OPS = AttentionOps(paged_attention, write_kv)
KERNEL_OPS = AttentionOps(paged_attention_decode_kernel, write_kv)  # decode through the kernel library
REFERENCE_OPS = AttentionOps(paged_attention_reference, write_kv_reference)
# weight_formats' key for a block-format embedding table (tied: the LM head's own tiles).
EMBED_KEY = "embed"


def linear_part_rows(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every linear module of the network -> the output rows of its fused parts, in order."""
    q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    rows: dict[str, tuple[int, ...]] = {}
    for i in range(spec.num_layers):
        rows[f"layers.{i}.attn.qkv"] = (q_dim, kv_dim, kv_dim)
        rows[f"layers.{i}.attn.o_proj"] = (spec.hidden_size,)
        if spec.is_moe:  # a mixture of experts: expert_part_shapes, and a dense router
            continue
        rows[f"layers.{i}.mlp.gate_up"] = (spec.intermediate_size, spec.intermediate_size)
        rows[f"layers.{i}.mlp.down"] = (spec.hidden_size,)
    rows["lm_head"] = (spec.vocab_size,)
    return rows


def expert_part_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Every stacked expert weight of the network (a mixture of experts; none in a dense one) -> one
    expert's [n, k]."""
    if not spec.is_moe:
        return {}
    return {
        f"layers.{i}.mlp.{name}": shape for i in range(spec.num_layers) for name, shape in expert_shapes(spec).items()
    }


# The head sizes the decode kernel is written for (16-lane vectors); others keep the torch path.
DECODE_KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)


def attention_ops(spec: ModelSpec, reference: bool, has_kernel_library: bool) -> AttentionOps:
    """The one place that picks the attention implementation of a network."""
    if reference:
        return REFERENCE_OPS
    if has_kernel_library and spec.head_dim in DECODE_KERNEL_HEAD_DIMS:
        return KERNEL_OPS
    return FAST_OPS


def rotary_tables(inv_freq: torch.Tensor, rope_scaling: float, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq_len, rotary dims] on the CPU (half-split layout, as HF Llama); the rotary
    dims are 2 x len(inv_freq): head_dim, or its first part (Phi-4-mini's partial_rotary_factor)."""
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device="cpu"), inv_freq.float().cpu())
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * rope_scaling, angles.sin() * rope_scaling


def rope_constants(
    spec: ModelSpec, inv_freq: torch.Tensor, rope_scaling: float, max_seq_len: int
) -> dict[str, torch.Tensor]:
    """Every rotary table the network holds, by buffer name: rope_cos/rope_sin from the stored
    inv_freq, and for a model whose sliding layers rotate by their own base (Gemma 3's
    rope_local_base_freq, default RoPE as transformers computes it) rope_local_cos/rope_local_sin."""
    cos, sin = rotary_tables(inv_freq, rope_scaling, max_seq_len)
    tables = {"rope_cos": cos, "rope_sin": sin}
    if spec.local_rope_theta is not None:
        dims = 2 * inv_freq.shape[-1]
        exponents = torch.arange(0, dims, 2, dtype=torch.int64, device="cpu").float() / dims
        local_inv_freq = 1.0 / (spec.local_rope_theta**exponents)
        tables["rope_local_cos"], tables["rope_local_sin"] = rotary_tables(local_inv_freq, 1.0, max_seq_len)
    return tables


class RMSNorm(nn.Module):
    """Llama's RMSNorm (weight times the normed input rounded to its dtype); with an offset,
    Gemma's: the normed input times (offset + weight), in fp32, then rounded."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = cast(x, torch.float32)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return cast(normed * (cast(self.weight, torch.float32) + self.offset), x.dtype)
        return self.weight * cast(normed, x.dtype)


def rotation_sines(sin: torch.Tensor) -> torch.Tensor:
    """sin [T, 1, R] with its first half negated, made once a step: rotate_half(x) * sin is then
    (x's halves swapped) * rotation_sines(sin), the same bits (negating a factor is exact) with one
    graph node fewer per rotation than rotate_half's negation. (x.roll for the swap is one node in the
    export but four in AOTInductor's re-trace, and it changed which bf16 products Inductor rounds.)"""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos and `rotation_sines` [T, 1, R] (half-split rotation, as HF Llama; the 1
    broadcasts over heads, made once a step, not per layer) over the first R <= D dims of each head;
    the rest pass through (partial rotary, as HF Phi-3)."""
    rotary_dims = cos.shape[-1]
    if rotary_dims < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary_dims], cos, signed_sin), x[..., rotary_dims:]), dim=-1)
    half = rotary_dims // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, block_size: int, ops: AttentionOps, index: int) -> None:
        super().__init__()
        self.rotary = index not in spec.no_rope_layers  # SmolLM3's NoPE layers: positions reach them only causally
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_dim, self.kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, self.q_dim + 2 * self.kv_dim, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_dim, spec.hidden_size, bias=spec.attention_out_bias)
        self.block_size = block_size
        self.scale = spec.attention_scale or spec.head_dim**-0.5
        # Mistral, Phi-3, Gemma 3's local layers: each query sees its last `window` keys; Gemma 2:
        # scores capped before the softmax
        self.variant = AttentionVariant(window=spec.layer_window(index), softcap=spec.attn_logit_softcap)
        # gpt-oss: a sink logit per query head in each softmax's denominator (kept fp32, as read)
        self.sinks: torch.Tensor | None = None
        if spec.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(spec.num_heads, dtype=torch.float32), requires_grad=False)
        self.ops = ops
        # Qwen3, Gemma 3 normalize each head's q and k before RoPE, OLMoE all heads together; an
        # identity keeps one forward for all
        self.qk_norm = spec.qk_norm
        self.qk_norm_across_heads = spec.qk_norm_across_heads
        q_width, k_width = (self.q_dim, self.kv_dim) if spec.qk_norm_across_heads else (spec.head_dim, spec.head_dim)
        self.q_norm: nn.Module = _norm_or_identity(spec, q_width, spec.qk_norm)
        self.k_norm: nn.Module = _norm_or_identity(spec, k_width, spec.qk_norm)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        layout: AttentionLayout,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv(x).split([self.q_dim + self.kv_dim, self.kv_dim], dim=-1)
        q, k = self._rotated_heads(qk, cos, signed_sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        self.ops.write_kv(k_pool, v_pool, slot_mapping, k, v)
        out = self.ops.attend(
            q, k_pool, v_pool, positions, layout, self.block_size, self.scale, self.variant, self.sinks
        )
        return self.o_proj(out.reshape(num_tokens, self.q_dim))

    def _rotated_heads(
        self, qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, q_dim + kv_dim] -> q [T, heads, D], k [T, kv_heads, D], normed and rotated. Without a
        q/k norm the two share one rotation over all their heads: the step graph's nodes grow with
        depth, and each is compile time (with `rotation_sines`, SmolLM2's step 1,953 -> 1,747 nodes)."""
        num_tokens = qk.shape[0]
        if not self.qk_norm:
            heads = qk.reshape(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            if self.rotary:
                heads = apply_rope(heads, cos, signed_sin)
            q, k = heads.split([self.num_heads, self.num_kv_heads], dim=1)
            return q, k
        q, k = qk.split([self.q_dim, self.kv_dim], dim=-1)
        if self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if not self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary:
            q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        return q, k


def _norm_or_identity(spec: ModelSpec, dim: int, present: bool) -> nn.Module:
    return RMSNorm(dim, spec.rms_norm_eps, spec.norm_weight_offset) if present else nn.Identity()


ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    Activation.SILU: F.silu,
    Activation.GELU_TANH: partial(F.gelu, approximate="tanh"),
}


class MLP(nn.Module):
    """SwiGLU (Llama), or GeGLU with gelu's tanh approximation (Gemma 3)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.act = ACTIVATIONS[spec.hidden_act]
        self.gate_up = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split([self.intermediate_size, self.intermediate_size], dim=-1)
        return self.down(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, block_size: int, ops: AttentionOps, index: int) -> None:
        super().__init__()
        self.local_rope = spec.uses_local_rope(index)  # Gemma 3's sliding layers: their own RoPE base
        self.input_norm = _norm_or_identity(spec, spec.hidden_size, True)
        self.attn = Attention(spec, block_size, ops, index)
        self.post_norm = _norm_or_identity(spec, spec.hidden_size, True)  # before the MLP
        self.mlp: nn.Module = MoeBlock(spec) if spec.is_moe else MLP(spec)
        # Gemma 3's sandwich: the attention's and the MLP's outputs normed before each residual add
        self.attn_out_norm = _norm_or_identity(spec, spec.hidden_size, spec.sandwich_norms)
        self.mlp_out_norm = _norm_or_identity(spec, spec.hidden_size, spec.sandwich_norms)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        layout: AttentionLayout,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> torch.Tensor:
        attended = self.attn(self.input_norm(x), cos, sin, positions, slot_mapping, layout, k_pool, v_pool)
        x = x + self.attn_out_norm(attended)
        return x + self.mlp_out_norm(self.mlp(self.post_norm(x)))


class StepNetwork(nn.Module):
    """The step contract as a module: packed tokens in, logits of the sampling rows out.

    kv_pools holds each layer's K pool then V pool, [num_slots, kv_heads, head_dim] each,
    mutated in place. Separate inputs (not views of one input) let the compiler write only the
    step's slots; a view of one big input made it copy the whole pool every layer.
    """

    def __init__(
        self,
        spec: ModelSpec,
        inv_freq: torch.Tensor,
        rope_scaling: float,
        max_seq_len: int,
        block_size: int,
        ops: AttentionOps = FAST_OPS,
        weight_formats: Mapping[str, WeightFormat] | None = None,
        weight_compute: WeightCompute = WeightCompute.FP32,
    ) -> None:
        super().__init__()
        self.spec = spec
        # module name (or `module[part]`, segmented_linear.py; or "embed") -> stored format; absent = dense
        self.weight_formats = dict(weight_formats or {})
        self.weight_compute = WeightCompute(weight_compute)  # how the block-format layers multiply
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, block_size, ops, index) for index in range(spec.num_layers))
        self.norm = _norm_or_identity(spec, spec.hidden_size, True)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        for name, rows in linear_part_rows(spec).items():
            self._store_linear(name, rows)
        for name in expert_part_shapes(spec):  # every one recorded, "fp32" too: the op is the library's
            moe_name, _, attr = name.rpartition(".")
            moe = self.get_submodule(moe_name)
            assert isinstance(moe, MoeBlock)
            moe.store_as(attr, self.weight_formats.get(name, WeightFormat.FP32), self.weight_compute)
        if EMBED_KEY in self.weight_formats:
            self._store_embedding(self.weight_formats[EMBED_KEY])
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.rope_local_cos: torch.Tensor  # only where spec.local_rope_theta is set
        self.rope_local_sin: torch.Tensor
        local_tables = LOCAL_ROPE_TABLES if spec.local_rope_theta is not None else ()
        for name in (*ROPE_TABLES, *local_tables):
            self.register_buffer(name, torch.empty(0), persistent=False)
        self.set_rope(inv_freq, rope_scaling, max_seq_len)

    def set_rope(self, inv_freq: torch.Tensor, rope_scaling: float, max_seq_len: int) -> None:
        """(Re)compute the rotary tables on the CPU (a network built on the meta device calls it again)."""
        for name, table in rope_constants(self.spec, inv_freq, rope_scaling, max_seq_len).items():
            setattr(self, name, table)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Assign a stored state (the network may have been built on the meta device): every tensor
        must be present, and a tied dense head is tied again to the assigned embedding."""
        state = dict(state)
        tied_dense_head = self.spec.tie_word_embeddings and isinstance(self.lm_head, nn.Linear)
        if tied_dense_head and isinstance(self.embed, nn.Embedding):
            state.setdefault("lm_head.weight", state["embed.weight"])
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"weights do not match the network: missing {missing}, unexpected {unexpected}")
        if tied_dense_head and isinstance(self.embed, nn.Embedding):
            self.lm_head.weight = self.embed.weight

    def _store_linear(self, name: str, part_rows: tuple[int, ...]) -> None:
        """Swap the nn.Linear `name` for what weight_formats records: one block format, one
        format per part, or (absent) leave it dense."""
        linear = self.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        per_part = part_formats(self.weight_formats, name, len(part_rows))
        replacement: nn.Module
        if per_part is not None:
            layout = segments(per_part, part_rows)
            replacement = SegmentedLinear(linear.in_features, layout, linear.bias is not None, self.weight_compute)
        elif name in self.weight_formats:
            fmt = self.weight_formats[name]
            replacement = QuantLinear(
                fmt, linear.in_features, linear.out_features, bias=linear.bias is not None, compute=self.weight_compute
            )
        else:
            return
        parent_name, _, attr = name.rpartition(".")
        setattr(self.get_submodule(parent_name) if parent_name else self, attr, replacement)

    def _store_embedding(self, fmt: WeightFormat) -> None:
        """The embedding as a block table: the tied head's own tiles where it shares them."""
        head = self.lm_head
        shares = self.spec.tie_word_embeddings and isinstance(head, QuantLinear) and head.fmt is fmt
        shared = head if shares and isinstance(head, QuantLinear) else None
        self.embed = QuantEmbedding(fmt, self.spec.vocab_size, self.spec.hidden_size, shared_head=shared)

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
    ) -> torch.Tensor:
        layout = AttentionLayout(
            context_query_rows, context_block_tables, decode_query_rows, decode_block_tables, decode_seq_lens, positions
        )
        x = self.embed_tokens(input_ids)
        x = run_layers(
            self.layers, x, rotary_rows(self, self.spec, positions, x.dtype), positions, slot_mapping, layout, kv_pools
        )
        return self.logits(x, logits_indices)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states a step starts from (a layer-chunked engine runs this eagerly)."""
        x = self.embed(input_ids)
        if self.spec.embed_scale is not None:  # Gemma: the scale rounded to the model dtype, as transformers
            x = x * torch.full((), self.spec.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def logits(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The last hidden states of the sampling rows -> their float32 logits."""
        return head_logits(self.spec, self.norm, self.lm_head, x, logits_indices)


ROPE_TABLES = ("rope_cos", "rope_sin")
LOCAL_ROPE_TABLES = ("rope_local_cos", "rope_local_sin")  # only where spec.local_rope_theta is set


@dataclass(frozen=True, slots=True)
class RotaryRows:
    """The rotary rows of one step's positions (cos, `rotation_sines`), made once and read by every
    layer; `local`: Gemma 3's sliding layers' own, where the model has them."""

    cos: torch.Tensor
    sin: torch.Tensor
    local: tuple[torch.Tensor, torch.Tensor] | None

    def of(self, layer: DecoderLayer) -> tuple[torch.Tensor, torch.Tensor]:
        if layer.local_rope and self.local is not None:
            return self.local
        return self.cos, self.sin


def rotary_rows(tables: nn.Module, spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype) -> RotaryRows:
    """`tables`' rotary buffers (ROPE_TABLES, and LOCAL_ROPE_TABLES where `spec` has them) at `positions`,
    rounded to the activations' dtype, [T, 1, R] (the 1 broadcasts over heads)."""

    def rows(cos_name: str, sin_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        cos_table, sin_table = tables.get_buffer(cos_name), tables.get_buffer(sin_name)
        cos = cast(cos_table[positions], dtype)[:, None, :]
        return cos, rotation_sines(cast(sin_table[positions], dtype)[:, None, :])

    cos, sin = rows(*ROPE_TABLES)
    local = rows(*LOCAL_ROPE_TABLES) if spec.local_rope_theta is not None else None
    return RotaryRows(cos, sin, local)


def run_layers(
    layers: nn.ModuleList,
    x: torch.Tensor,
    rows: RotaryRows,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: AttentionLayout,
    kv_pools: list[torch.Tensor],
) -> torch.Tensor:
    """`layers` in order; kv_pools holds each one's K pool then V pool."""
    for index, layer in enumerate(layers):
        assert isinstance(layer, DecoderLayer)
        cos, sin = rows.of(layer)
        x = layer(x, cos, sin, positions, slot_mapping, layout, kv_pools[2 * index], kv_pools[2 * index + 1])
    return x


def head_logits(
    spec: ModelSpec, norm: nn.Module, lm_head: nn.Module, x: torch.Tensor, logits_indices: torch.Tensor
) -> torch.Tensor:
    logits = lm_head(norm(x[logits_indices]))
    if spec.final_logit_softcap is not None:  # Gemma 2, in the model dtype as transformers
        cap = spec.final_logit_softcap
        logits = torch.tanh(logits / cap) * cap
    return cast(logits, torch.float32)
