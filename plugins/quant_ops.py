"""The ifb_quant torch ops: schemas, fake kernels, tile packing and a pure-torch reference.

`quant_linear(x, packed, fmt, n, k)` is y = x @ W^T for a weight W [n, k] stored as packed
block tiles. The CPU kernel (plugins/csrc/quant_matmul.cpp, loaded by
`quant_build.load_quant_library`) gives a batch-invariant result: each y[m, j] is one serial
chain of fp32 FMAs over k = 0..K-1 of x[m, k] and the exact dequantized weight, so a row's
output is bitwise the same whatever M is, wherever the row sits in the batch and however many
threads run (threads split output columns only).

Packed layout (`pack`): N is padded to a multiple of 16 with zero blocks, and each group of 16
output columns ("tile") stores its K/32 blocks as tile-blocks of 16 interleaved GGUF blocks:

    Q4_0  d[16] fp16 | quants[16 rows][16 cols]            = 16 x 18 B
    Q4_1  d[16] fp16 | m[16] fp16 | quants[16][16]         = 16 x 20 B
    Q8_0  d[16] fp16 | quants[32 rows][16 cols] int8       = 16 x 34 B

Q4 quants row i, byte c: column c's elements 2i (low nibble) and 2i+1 (high nibble). Q8 row i,
byte c: column c's element i. The values are GGUF's own bits, only moved, so the dequantized
weights are exactly those of `quant_formats.dequantize`. Tensor: uint8 [ceil(N/16), K/32 * 16 *
block_bytes].

AOTInductor calls the op through a C shim exported by the library (`AOTI_CONFIGS`), not through
the proxy executor: see quant_build.py for the load order the runtime needs.
"""

from __future__ import annotations

import torch

from ifb.plugins.quant_formats import BLOCK_SIZE, WeightFormat, block_bytes, dequantize

TILE_COLUMNS = 16

_LIBRARY = torch.library.Library("ifb_quant", "DEF")
_LIBRARY.define("quant_matmul(Tensor x, Tensor packed, str format, int n, int k) -> Tensor")
_LIBRARY.define("quant_matmul_int8(Tensor x, Tensor packed, str format, int n, int k) -> Tensor")
_LIBRARY.define(
    "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, "
    "int block_size, float scale) -> Tensor"
)
_LIBRARY.define("quant_dequantize(Tensor packed, str format, int n, int k) -> Tensor")

# The shim's C declaration: AOTInductor emits `extern` + this and calls it for the op.
QUANT_MATMUL_SHIM = (
    "AOTITorchError aoti_torch_cpu_quant_matmul(AtenTensorHandle x, AtenTensorHandle packed, const char* format, "
    "int64_t n, int64_t k, AtenTensorHandle* ret0)"
)

QUANT_MATMUL_INT8_SHIM = QUANT_MATMUL_SHIM.replace("quant_matmul(", "quant_matmul_int8(")
PAGED_DECODE_ATTENTION_SHIM = (
    "AOTITorchError aoti_torch_cpu_paged_decode_attention(AtenTensorHandle q, AtenTensorHandle k_pool, "
    "AtenTensorHandle v_pool, AtenTensorHandle block_tables, AtenTensorHandle seq_lens, int64_t block_size, "
    "double scale, AtenTensorHandle* ret0)"
)


def aoti_configs() -> dict[str, object]:
    """The inductor_configs entries that make AOTInductor call the matmul ops through their C shims."""
    shims = {
        torch.ops.ifb_quant.quant_matmul.default: [QUANT_MATMUL_SHIM],
        torch.ops.ifb_quant.quant_matmul_int8.default: [QUANT_MATMUL_INT8_SHIM],
        torch.ops.ifb_quant.paged_decode_attention.default: [PAGED_DECODE_ATTENTION_SHIM],
    }
    return {"aot_inductor.custom_ops_to_c_shims": shims}


@torch.library.register_fake("ifb_quant::quant_matmul")
def _quant_matmul_fake(x: torch.Tensor, packed: torch.Tensor, format: str, n: int, k: int) -> torch.Tensor:
    torch._check(x.shape[-1] == k)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("ifb_quant::quant_matmul_int8")
def _quant_matmul_int8_fake(x: torch.Tensor, packed: torch.Tensor, format: str, n: int, k: int) -> torch.Tensor:
    torch._check(x.shape[-1] == k)
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("ifb_quant::paged_decode_attention")
def _paged_decode_attention_fake(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.register_fake("ifb_quant::quant_dequantize")
def _quant_dequantize_fake(packed: torch.Tensor, format: str, n: int, k: int) -> torch.Tensor:
    return packed.new_empty((n, k), dtype=torch.float32)


def quant_linear(x: torch.Tensor, packed: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """x [..., k] fp32 @ W[n, k]^T with W packed by `pack`; needs the library loaded."""
    return torch.ops.ifb_quant.quant_matmul(x, packed, fmt.value, n, k)


def quant_linear_int8(x: torch.Tensor, packed: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """`--compute int8`: x quantized per row and 32-block to int8, W packed by `pack_int8`."""
    return torch.ops.ifb_quant.quant_matmul_int8(x, packed, fmt.value, n, k)


def kernel_dequantize(packed: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """The fp32 weights [n, k] as the kernel dequantizes them in registers."""
    return torch.ops.ifb_quant.quant_dequantize(packed, fmt.value, n, k)


def num_tiles(n: int) -> int:
    return -(-n // TILE_COLUMNS)


def _tile_block(blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """[T, nb, 16 cols, block_bytes] GGUF blocks -> [T, nb, 16 * block_bytes] tile-blocks."""
    scale_bytes = 4 if fmt is WeightFormat.Q4_1 else 2
    scales = blocks[..., :scale_bytes]
    fields = [scales[..., 2 * i : 2 * i + 2].flatten(-2) for i in range(scale_bytes // 2)]
    quants = blocks[..., scale_bytes:]
    if fmt is WeightFormat.Q8_0:
        fields.append(quants.transpose(-1, -2).flatten(-2))
    else:
        values = torch.cat([quants & 0x0F, quants >> 4], dim=-1)  # GGUF order: element e at e
        pairs = values[..., 0::2] | (values[..., 1::2] << 4)  # byte i: elements 2i, 2i+1
        fields.append(pairs.transpose(-1, -2).flatten(-2))
    return torch.cat(fields, dim=-1)


def pack(blocks: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """GGUF rows of blocks uint8 [n, k/32 * block_bytes] -> the kernel's tile layout."""
    tiles = _tiles(blocks, fmt, n, k)
    return _tile_block(tiles, fmt).reshape(tiles.shape[0], -1).contiguous()


def _tile_block_int8(blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """[T, nb, 16 cols, block_bytes] GGUF blocks -> [T, nb, 16 * block_bytes] int8-mode tile-blocks.

    Scales as in `_tile_block`; quants in 64-byte groups with one 4-byte lane per column
    (quant_matmul_int8.cpp): Q4 group g lane byte b = w[8g+b] | w[8g+4+b] << 4, Q8 = w[4g+b].
    """
    scale_bytes = 4 if fmt is WeightFormat.Q4_1 else 2
    scales = blocks[..., :scale_bytes]
    fields = [scales[..., 2 * i : 2 * i + 2].flatten(-2) for i in range(scale_bytes // 2)]
    quants = blocks[..., scale_bytes:]
    lead = quants.shape[:-2]
    if fmt is WeightFormat.Q8_0:
        lanes = quants.reshape(*lead, TILE_COLUMNS, 8, 4)  # [.., col, g, b]
    else:
        values = torch.cat([quants & 0x0F, quants >> 4], dim=-1).reshape(*lead, TILE_COLUMNS, 4, 8)
        lanes = values[..., :4] | (values[..., 4:] << 4)  # [.., col, g, b]
    fields.append(lanes.transpose(-3, -2).flatten(-3))  # [.., g, col, b]
    return torch.cat(fields, dim=-1)


def _tiles(blocks: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """GGUF rows of blocks -> [tiles, nb, 16 cols, block_bytes], N padded with zero blocks."""
    size = block_bytes(fmt)
    num_blocks = k // BLOCK_SIZE
    if k % BLOCK_SIZE or blocks.shape != (n, num_blocks * size) or blocks.dtype != torch.uint8:
        raise ValueError(f"expected uint8 [{n}, {num_blocks * size}] {fmt.value} blocks, got {tuple(blocks.shape)}")
    tiles = num_tiles(n)
    padded = blocks.new_zeros((tiles * TILE_COLUMNS, num_blocks * size))
    padded[:n] = blocks
    return padded.reshape(tiles, TILE_COLUMNS, num_blocks, size).transpose(1, 2)


def pack_int8(blocks: torch.Tensor, fmt: WeightFormat, n: int, k: int) -> torch.Tensor:
    """GGUF rows of blocks uint8 [n, k/32 * block_bytes] -> the int8-compute kernel's tiles
    (same shape as `pack`'s, the same bytes rearranged)."""
    tiles = _tiles(blocks, fmt, n, k)
    return _tile_block_int8(tiles, fmt).reshape(tiles.shape[0], -1).contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (int8 values [M, K], scales [M, K/32]) as the int8 kernel quantizes:
    d = max|x| / 127 per 32-block, q = round-half-even(x * (1 / d))."""
    blocks = x.to(torch.float32).reshape(x.shape[0], -1, BLOCK_SIZE)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(blocks * inverse)
    return q.reshape(x.shape).to(torch.int8), d.squeeze(-1)


def reference_matmul_int8(x: torch.Tensor, blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """What the int8 kernel computes, in float64: quantized x @ dequantize(blocks)^T."""
    q, d = quantize_activations(x.reshape(-1, x.shape[-1]))
    x_hat = q.to(torch.float64).reshape(q.shape[0], -1, BLOCK_SIZE) * d.to(torch.float64)[..., None]
    return x_hat.reshape(q.shape) @ dequantize(blocks, fmt).to(torch.float64).T


def reference_matmul(x: torch.Tensor, blocks: torch.Tensor, fmt: WeightFormat) -> torch.Tensor:
    """x @ dequantize(blocks)^T in float64: what the kernel approximates in fp32."""
    return x.to(torch.float64) @ dequantize(blocks, fmt).to(torch.float64).T
