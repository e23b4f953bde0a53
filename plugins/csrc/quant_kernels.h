// Block-quantized weight matmul kernels: the torch-free interface between kernel and binding.
//
// The kernel translation unit (quant_matmul.cpp) includes no torch header so it compiles in about
// a second with the ISA flags; the binding (quant_binding.cpp) owns threading and tensors.
#pragma once

#include <cstdint>
#include <vector>

#include "block_format_table.h"

namespace ifb_quant {

// The block formats: one enumerator per entry of block_format_table.h (kQ4_0, ...), in its order.
enum class Format : int32_t {
#define IFB_FORMAT_ENUMERATOR(id, name, bytes, weights) k##id,
  IFB_BLOCK_FORMATS(IFB_FORMAT_ENUMERATOR)
#undef IFB_FORMAT_ENUMERATOR
};

// The one table of block formats, expanded from block_format_table.h (generated from
// plugins/quant_formats.py's WeightFormat): the name the enum's value spells, GGUF block bytes
// and weights per block along K.
struct FormatInfo {
  const char* name;
  Format format;
  int64_t bytes;
  int64_t weights;
};
constexpr FormatInfo kFormats[] = {
#define IFB_FORMAT_INFO(id, name, bytes, weights) {name, Format::k##id, bytes, weights},
    IFB_BLOCK_FORMATS(IFB_FORMAT_INFO)
#undef IFB_FORMAT_INFO
};
constexpr const FormatInfo& format_info(Format format) { return kFormats[static_cast<int32_t>(format)]; }

constexpr int64_t kTileColumns = 16;  // output columns per packed tile (one AVX-512 register)
constexpr int64_t kBlockSize = 32;    // weights per (sub-)block the kernels step through along K
// Column tiles the int8 kernel walks as one group (every row block over them before the next
// group), and the unit the binding hands out to threads: a split inside a group would cut a
// register block of several tiles into single tiles.
constexpr int64_t kGroupTiles = 4;

// One y[M,N] = x[M,K] @ W[N,K]^T problem over tile-packed weights (see quant_ops.py).
struct Problem {
  const float* x;
  int64_t x_row_stride;
  const uint8_t* packed;
  float* y;
  int64_t y_row_stride;
  int64_t m;
  int64_t n;
  int64_t k;
  Format format;
};

// Bytes of one GGUF block (18 ... 210); a packed tile-block holds kTileColumns of them.
constexpr int64_t block_bytes(Format format) { return format_info(format).bytes; }
// Weights per GGUF block along K: 32, or 256 for the K-quants' super-blocks.
constexpr int64_t block_weights(Format format) { return format_info(format).weights; }

// Number of column tiles: ceil(n / kTileColumns). Threads split [0, num_tiles) only.
int64_t num_tiles(int64_t n);

// Computes the output columns of tiles [tile_begin, tile_end) for every row of the problem.
void run_tiles(const Problem& problem, int64_t tile_begin, int64_t tile_end);

// Writes the exact fp32 weights W[n, k] (row-major [N, K]) of tiles [tile_begin, tile_end),
// with the same in-register dequantization the matmul uses.
void dequantize_tiles(const uint8_t* packed, Format format, int64_t n, int64_t k, float* out,
                      int64_t tile_begin, int64_t tile_end);

// --compute int8: activations quantized per row and per 32-block (quant_matmul_int8.cpp).
struct Int8Activations {
  int8_t* xq;             // [m, k]
  int64_t xq_row_stride;
  float* x_scales;        // [m, k / 32]: d_x
  int32_t* x_sums;        // [m, k / 32]: sum of the block's int8 values
  float* x_scaled_sums;   // [m, k / 32]: d_x * sum
  int32_t* x_half_sums;   // [m, k / 16]: sums of each 16 values (Q6_K's scale groups)
  int64_t blocks_row_stride;
};

struct Int8Problem {
  const int8_t* xq;
  int64_t xq_row_stride;
  const float* x_scales;
  const int32_t* x_sums;
  const float* x_scaled_sums;
  const int32_t* x_half_sums;  // row stride 2 * blocks_row_stride
  int64_t blocks_row_stride;
  const uint8_t* packed;  // plugins/quant_ops.py::pack_int8 layout
  float* y;
  int64_t y_row_stride;
  int64_t m;
  int64_t n;
  int64_t k;
  Format format;
};

// Quantizes rows [row_begin, row_end) of x [*, k] into `out` (each row independently).
void quantize_rows_int8(const float* x, int64_t x_row_stride, int64_t k, int64_t row_begin, int64_t row_end,
                        const Int8Activations& out);

// The int8-compute counterpart of run_tiles: output columns of tiles [tile_begin, tile_end).
void run_tiles_int8(const Int8Problem& problem, int64_t tile_begin, int64_t tile_end);

// dequantize_tiles for the pack_int8 layout (the same exact weights, read from its byte order).
void dequantize_tiles_int8(const uint8_t* packed, Format format, int64_t n, int64_t k, float* out,
                           int64_t tile_begin, int64_t tile_end);

// Embedding gather: out[i, :] = W[ids[i], :] for i in [row_begin, row_end), exact fp32, read from
// tiles packed for compute mode `int8_layout` (pack_int8) or not (pack). ids checked by the caller.
void gather_rows(const uint8_t* packed, Format format, bool int8_layout, int64_t n, int64_t k, const int64_t* ids,
                 int64_t row_begin, int64_t row_end, float* out);

// "vnni" or "maddubs": how the int8 path forms its integer dot products.
const char* int8_dot_path();

// How many column tiles a one-row int8 pass over a nibble-format or Q8_0 matrix streams at once:
// a speed choice by CPU (quant_matmul_int8.cpp), never a change of bits. `set_one_row_tiles`
// takes 1, wide_one_row_tiles() or 0 (the CPU's own choice again) and refuses anything else.
int one_row_tiles();
int wide_one_row_tiles();
bool set_one_row_tiles(int tiles);

// Paged decode attention (paged_decode_attention.cpp): what the K/V pools hold.
// kQ8_0: uint8 rows of head_dim int8 then fp16 scales per 32 (plugins/kv_format.py).
enum class KvType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kQ8_0 = 3 };

// out[r, h, :] = softmax(q[r, h, :] . K_r * scale) V_r over the first seq_lens[r] positions of
// request r, K/V read from the pools [num_slots, num_kv_heads, head_dim] through block_tables.
struct DecodeAttentionProblem {
  const float* q;  // [num_rows, num_heads, head_dim]
  int64_t num_rows;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;  // 16, 32, 64, 128 or 256
  const void* k_pool;
  const void* v_pool;
  KvType kv_type;
  const int64_t* block_tables;  // [num_rows, table_stride]
  int64_t table_stride;
  const int64_t* seq_lens;  // [num_rows]
  int64_t block_size;
  float scale;
  float* out;  // [num_rows, num_heads, head_dim]
  // Sliding window: a row of length L attends to keys [max(0, L - window), L); 0 = all L keys.
  int64_t window = 0;
  // Gemma 2's attention-logit soft-capping: each scaled score s becomes cap * tanh(s / cap); 0 = none.
  float softcap = 0.0f;
  // gpt-oss's attention sinks: [num_heads] logits, each joining its head's softmax max and
  // denominator and weighting no value; nullptr = none.
  const float* sinks = nullptr;
};

// Query rows [row_begin, row_end) that share one block table (a request's rows in a prefill
// chunk): the kernel reads their keys once for the whole tile, each row's bits as decode's.
struct AttentionTile {
  int64_t row_begin;
  int64_t row_end;
};
// Rows per tile at most: a tile's scores (rows x group heads x keys) stay in L2.
constexpr int64_t kAttentionTileRows = 8;

// The problem's rows as tiles: consecutive rows with the same block table row, in row order.
std::vector<AttentionTile> plan_attention_tiles(const DecodeAttentionProblem& problem);

// Items [item_begin, item_end) of num_kv_heads * tiles.size() (KV-head-major): each computed alone.
void run_paged_attention_items(const DecodeAttentionProblem& problem, const std::vector<AttentionTile>& tiles,
                               int64_t item_begin, int64_t item_end);

// "avx512" or "avx2": the path this library was compiled for.
const char* isa_name();

}  // namespace ifb_quant
