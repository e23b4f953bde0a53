"""The ifb_quant torch ops: schemas, fake kernels, tile packing and a pure-torch reference.

`quant_linear(x, packed, fmt, n, k)` is y = x @ W^T for a weight W [n, k] stored as packed
block tiles. The CPU kernel (plugins/csrc/quant_matmul.cpp, loaded by
`quant_build.load_quant_library`) gives a batch-invariant result: each y[m, j] is one serial
chain of fp32 FMAs over k = 0..K-1 of x[m, k] and the exact dequantized weight, so a row's
output is bitwise the same whatever M is, wherever the row sits in the batch and however many
threads run (threads split output columns only).

Packed layout (`pack` and `pack_int8`): N is padded to a multiple of 16 with zero blocks, and
each group of 16 output columns ("tile") stores its K/block_weights GGUF blocks as tile-blocks
of 16 interleaved blocks (one per column), so one vector load reads a field of all 16 columns.
Sizes are GGUF's (16 x block_bytes): the values are GGUF's own bits, only moved, so the kernel's
weights are exactly `quant_formats.dequantize`'s. A tile-block is its scale fields, then the
bits above the nibbles (Q5: 5th bits; Q6_K: 2-bit highs), then the nibbles (or Q8_0's bytes):

    Q4_0  d[16] | quants                   Q5_0  d[16] | qh | quants
    Q4_1  d[16] | m[16] | quants           Q5_1  d[16] | m[16] | qh | quants
    Q8_0  d[16] | int8 quants[32 k][16]
    Q4_K  d[16] | dmin[16] | scales[12 bytes][16] | quants per sub-block s = 0..7
    Q5_K  d[16] | dmin[16] | scales[12][16] | (qh, quants) per sub-block
    Q6_K  d[16] | scales[16 groups][16] int8 | (highs, quants) per sub-block
    MXFP4 e[16] (e8m0 bytes) | quants      (nibbles as Q4_0's; the kernel maps codes to values)

(fp16 fields as [16 columns]; K-quants' 12 scale bytes and Q6_K's 16 scales as GGUF stores them,
byte row r = byte r of every column.) Per 32-weight (sub-)block, 16 columns x 16 bytes of nibbles
and the high bits, in two orders:

    pack (exact):  nibbles row i, byte c: column c's weights 2i (low) and 2i+1 (high)
                   qh: a uint32 per column, bit e = weight e's 5th bit
                   Q6_K highs: 2 rows h of a uint32 per column, bits 2e' = weight 16h + e'
                   Q8_0: row k, byte c = column c's weight k
    pack_int8:     nibbles group g = 0..3, column c's 4-byte lane, byte b: weight 8g+b (low) and
                   8g+4+b (high), so one 64-byte load is 16 columns x 4 consecutive k
                   qh: lane byte b, bit g = weight 8g+b's, bit 4+g = weight 8g+4+b's 5th bit
                   Q6_K highs: 2 vectors v, lane byte b: weight 16v+4p+b's 2 bits at bit
                   (4, 6, 0, 2)[p], so the kernel shifts only half of them
                   Q8_0: group g = 0..7, lane byte b = weight 4g+b

Tensor: uint8 [ceil(N/16), K/block_weights * 16 * block_bytes].
`pack` and `pack_int8` are `quant_pack.pack_tiles` (each field moved in whole words, ~20x the
speed of unpacking every weight); `quant_pack_reference` spells the layouts out weight by weight and
is the definition the packer is tested against byte for byte.

`quant_embedding(ids, packed, ...)` gathers exact rows of W from either packing, so a tied
embedding reads the LM head's tiles.

AOTInductor calls the op through a C shim exported by the library (`AOTI_CONFIGS`), not through
the proxy executor: see quant_build.py for the load order the runtime needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ifb.plugins.quant_formats import (
    BLOCK_SIZE,
    WeightCompute,
    WeightFormat,
    dequantize,
)
from ifb.plugins.quant_pack import TILE_COLUMNS as TILE_COLUMNS  # re-exported: the layout's constants
from ifb.plugins.quant_pack import num_tiles as num_tiles
from ifb.plugins.quant_pack import pack_tiles

_LIBRARY = torch.library.Library("ifb_quant", "DEF")
# `str format` is a WeightFormat's value (`kernel_format`), which the C++ side looks up in the
# table generated from the enum (csrc/block_format_table.h). A string rather than an index: a
# compiled step package holds these names as literals in its calls to the shims below, and an
# engine's own kernel library implements this schema, so built engines keep loading.
_LIBRARY.define("quant_matmul(Tensor x, Tensor packed, str format, int n, int k) -> Tensor")
_LIBRARY.define("quant_matmul_int8(Tensor x, Tensor packed, str format, int n, int k) -> Tensor")
# The one attention op (plugins/attention_variant.py): the variant's fields as a string of named
# values, the sinks as an optional tensor, so a later variant needs no new op or C signature.
_LIBRARY.define(
    "paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
    "int block_size, float scale, str variant, Tensor? sinks) -> Tensor"
)
# The three ops engines built before that contract call: a compiled step names its op's shim, so
# their libraries' schemas and shims stay (csrc/quant_binding.cpp). New steps never call them.
_LIBRARY.define(
    "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
    "int block_size, float scale) -> Tensor"
)
_LIBRARY.define(
    "paged_decode_attention_window(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
    "int block_size, float scale, int window) -> Tensor"
)
_LIBRARY.define(
    "paged_decode_attention_softcap(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
    "int block_size, float scale, int window, float softcap) -> Tensor"
)
_LIBRARY.define("quant_dequantize(Tensor packed, str format, int n, int k) -> Tensor")
_LIBRARY.define("quant_embedding(Tensor ids, Tensor packed, str format, str compute, int n, int k) -> Tensor")

# The shim's C declaration: AOTInductor emits `extern` + this and calls it for the op.
QUANT_MATMUL_SHIM = (
    "AOTITorchError aoti_torch_cpu_quant_matmul(AtenTensorHandle x, AtenTensorHandle packed, const char* format, "
    "int64_t n, int64_t k, AtenTensorHandle* ret0)"
)

QUANT_MATMUL_INT8_SHIM = QUANT_MATMUL_SHIM.replace("quant_matmul(", "quant_matmul_int8(")
QUANT_EMBEDDING_SHIM = (
    "AOTITorchError aoti_torch_cpu_quant_embedding(AtenTensorHandle ids, AtenTensorHandle packed, const char* format, "
    "const char* compute, int64_t n, int64_t k, AtenTensorHandle* ret0)"
)
# An optional tensor reaches a C shim as a pointer to its handle (nullptr for None).
PAGED_ATTENTION_SHIM = (
    "AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k_pool, "
    "AtenTensorHandle v_pool, AtenTensorHandle block_tables, AtenTensorHandle seq_lens, int64_t block_size, "
    "double scale, const char* variant, AtenTensorHandle* sinks, AtenTensorHandle* ret0)"
)


def aoti_configs() -> dict[str, object]:
    """The inductor_configs entries that make AOTInductor call our ops through their C shims."""
    shims = {
        torch.ops.ifb_quant.quant_matmul.default: [QUANT_MATMUL_SHIM],
        torch.ops.ifb_quant.quant_matmul_int8.default: [QUANT_MATMUL_INT8_SHIM],
        torch.ops.ifb_quant.paged_attention.default: [PAGED_ATTENTION_SHIM],
        torch.ops.ifb_quant.quant_embedding.default: [QUANT_EMBEDDING_SHIM],
    }
    from ifb.plugins.grouped_experts import grouped_experts_shims  # its ops' schemas live with them

    shims.update(grouped_experts_shims())
    return {"aot_inductor.custom_ops_to_c_shims": shims}


@torch.library.register_fake("ifb_quant::quant_matmul")
def _quant_matmul_fake(x: torch.Tensor, packed: torch.Tensor, format: str, n: int, k: int) -> torch.Tensor:
    torch._check(x.shape[-1] == k)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("ifb_quant::quant_matmul_int8")
def _quant_matmul_int8_fake(x: torch.Tensor, packed: torch.Tensor, format: str, n: int, k: int) -> torch.Tensor:
    torch._check(x.shape[-1] == k)
    return x.new_empty((*x.shape[:-1], n))


def _paged_attention_fake(q: torch.Tensor, *tables_constants_and_sinks: object) -> torch.Tensor:
    """Every attention op (the contract's and the three before it): the output is q's shape and dtype."""
    return torch.empty_like(q)


for _op in (
    "paged_attention",
    "paged_decode_attention",
    "paged_decode_attention_window",
    "paged_decode_attention_softcap",
):
    torch.library.register_fake(f"ifb_quant::{_op}")(_paged_attention_fake)


@torch.library.register_fake("ifb_quant::quant_dequantize")
def _quant_dequantize_fake(packed: torch.Tensor, format: str, n: int, k: int) -> torch.Tensor:
    return packed.new_empty((n, k), dtype=torch.float32)


@torch.library.register_fake("ifb_quant::quant_embedding")
def _quant_embedding_fake(
    ids: torch.Tensor, packed: torch.Tensor, format: str, compute: str, n: int, k: int
) -> torch.Tensor:
    return packed.new_empty((*ids.shape, k), dtype=torch.float32)


def kernel_format(fmt: WeightFormat) -> str:
    """The ops' `format` argument for `fmt`: its value, the name the kernels' table gives it."""
    if not fmt.is_block:
        raise ValueError(f"the ifb_quant kernels read block formats only, not {fmt.value}")
    return fmt.value


def quant_linear(x: torch.Tensor, packed: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """x [..., k] fp32 @ W[n, k]^T with W packed by `pack`; needs the library loaded."""
    return torch.ops.ifb_quant.quant_matmul(x, packed, kernel_format(fmt), n, k)


def quant_linear_int8(x: torch.Tensor, packed: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """`--compute int8`: x quantized per row and 32-block to int8, W packed by `pack_int8`."""
    return torch.ops.ifb_quant.quant_matmul_int8(x, packed, kernel_format(fmt), n, k)


def kernel_dequantize(packed: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """The fp32 weights [n, k] as the kernel dequantizes them in registers."""
    return torch.ops.ifb_quant.quant_dequantize(packed, kernel_format(fmt), n, k)


def quant_embedding(
    ids: torch.Tensor, packed: torch.Tensor, fmt: WeightFormat, compute: WeightCompute, n: int, k: int
) -> torch.Tensor:
    """Rows `ids` of W [n, k] as exact fp32 [*ids.shape, k], read from the tiles `pack` (compute fp32)
    or `pack_int8` (compute int8) made; an id outside [0, n) raises. Needs the library loaded."""
    return torch.ops.ifb_quant.quant_embedding(ids, packed, kernel_format(fmt), WeightCompute(compute).value, n, k)


def pack(blocks: torch.Tensor | Sequence[torch.Tensor], fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """GGUF rows of blocks uint8 [n, k/block_weights * block_bytes] (or those rows in row-wise parts,
    packed as their concatenation) -> the exact kernel's tiles."""
    return pack_tiles(blocks, fmt, n, k, int8_layout=False)


def pack_int8(blocks: torch.Tensor | Sequence[torch.Tensor], fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """GGUF rows of blocks -> the int8-compute kernel's tiles (same shape as `pack`'s, bytes rearranged)."""
    return pack_tiles(blocks, fmt, n, k, int8_layout=True)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (int8 values [M, K], scales [M, K/32]) as the int8 kernel quantizes:
    d = max|x| / 127 per 32-block, q = round-half-even(x * (1 / d))."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, BLOCK_SIZE)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(blocks * inverse)
    return q.reshape(x.shape).to(torch.int8), d.squeeze(-1)


def reference_matmul_int8(x: torch.Tensor, blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """What the int8 kernel computes, in float64: quantized x @ dequantize(blocks)^T (every format:
    activations are quantized per 32 whatever the weight's block size)."""
    q, d = quantize_activations(x.reshape(-1, x.shape[-1]))
    x_hat = q.to(torch.float64).reshape(q.shape[0], -1, BLOCK_SIZE) * d.to(torch.float64)[..., None]
    return x_hat.reshape(q.shape) @ dequantize(blocks, fmt).to(torch.float64).T


def reference_matmul(x: torch.Tensor, blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """x @ dequantize(blocks)^T in float64: what the kernel approximates in fp32."""
    return x.to(torch.float64) @ dequantize(blocks, fmt).to(torch.float64).T
