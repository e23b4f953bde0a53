// Block-quantized weight matmul kernels (Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K/MXFP4), AVX-512 or AVX2.
//
// y[m, n] = sum_k x[m, k] * w[n, k], where w is dequantized in registers to its exact fp32 value
// (the value gguf.quants.dequantize gives) and every output element is one serial chain of fp32
// FMAs over k = 0, 1, ..., K-1 starting from +0. Output columns sit in vector lanes and x[m, k] is
// broadcast, so no code path reorders or splits that chain: the same bits come out whatever M is,
// wherever the row sits in the batch, and however many threads split the column tiles.
//
// The tile loops below know no format: they step K in 32-weight (sub-)blocks and ask
// block_formats.h's Block<F> for the exact weights of k = 2i, 2i+1 of 16 columns (the packed
// tile-block layouts are documented in plugins/quant_ops.py). At M = 1 this costs ~3 FP-pipe
// instructions per 16 weights (int -> float, the decode FMA, the product FMA), so it runs near
// 9-10 GB/s of weights per Zen 4 core rather than at memory bandwidth; `--compute int8` gets there.
//
// Two schedules, same per-element arithmetic: M <= kDirectRows dequantizes in registers right
// before the FMAs (several tiles side by side to hide FMA latency); larger M dequantizes a
// 128-k chunk of a tile pair into an L1 panel that every 12-row block reads, parking the FMA
// chains in y between chunks (an exact fp32 store/load). Threads only ever split tiles.
//
// Compiled with -ffp-contract=off: every rounding below is spelled out by an intrinsic.
#include <algorithm>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "block_formats.h"
#include "quant_kernels.h"

namespace ifb_quant {
namespace {

#if defined(IFB_SIMD16_AVX512)
#if defined(__AVX512VNNI__)
constexpr const char* kIsa = "avx512_vnni";  // only the int8 compute mode uses VNNI
#else
constexpr const char* kIsa = "avx512";
#endif
// 12 rows x 2 tiles = 24 accumulators of the 32 zmm registers.
constexpr int kPanelTiles = 2;
constexpr int kPanelRows = 12;
#else
constexpr const char* kIsa = "avx2";
// 6 rows x 1 tile x 2 ymm = 12 accumulators of the 16 ymm registers.
constexpr int kPanelTiles = 1;
constexpr int kPanelRows = 6;
#endif

// Small M dequantizes each weight in registers right before its FMAs; above this many rows the
// tile is dequantized once per K-chunk into an L1-resident panel reused by every row block.
#if defined(__AVX512F__)
constexpr int kDirectRows = 8;
#else
constexpr int kDirectRows = 4;  // 4 rows x 2 ymm of accumulators already take half the registers
#endif

// Tiles the direct path runs side by side. With one row, one tile is a single serial FMA chain
// and latency-bound (4 cycles per k on Zen 4: 15.9 GB/s of Q4_1 at M=1 on 2 cores); independent
// tiles fill the FMA pipes without touching any element's own chain.
constexpr int direct_tiles_for(int rows) {
#if defined(__AVX512F__)
  return rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
#else
  return rows == 1 ? 2 : 1;
#endif
}

// K is walked in chunks of this many blocks in the panel path: 128 k x 32 columns x 4 B = 16 KB
// of panel stays in L1 while every row block reads it (the whole K panel spilled to L2).
constexpr int64_t kChunkBlocks = 4;

inline void store_columns(float* dst, V v, int64_t valid) {
  if (valid >= kTileColumns) {
    store(dst, v);
    return;
  }
  alignas(64) float tmp[kTileColumns];
  store(tmp, v);
  std::memcpy(dst, tmp, static_cast<size_t>(valid) * sizeof(float));
}

inline V load_columns(const float* src, int64_t valid) {
  if (valid >= kTileColumns) return load(src);
  alignas(64) float tmp[kTileColumns] = {};
  std::memcpy(tmp, src, static_cast<size_t>(valid) * sizeof(float));
  return load(tmp);
}

// Rows [row0, row0 + R) of tiles [tile0, tile0 + T), weights dequantized on the fly.
template <Format F, int R, int T>
void direct_tiles(const Problem& p, int64_t tile0, int64_t row0) {
  const int64_t num_blocks = p.k / kBlockSize;
  const int64_t stride = tile_stride<F>(p.k);
  const uint8_t* tiles = p.packed + tile0 * stride;
  const float* x = p.x + row0 * p.x_row_stride;
  V acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = zero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* xb = x + b * kBlockSize;
    Block<F> block[T];
    for (int t = 0; t < T; ++t) block[t] = Block<F>(tiles + t * stride, b);
    // Unrolled: each pair's high-bit positions become constant shifts.
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      V w[2][T];
      for (int t = 0; t < T; ++t) block[t].exact_pair(i, w[0][t], w[1][t]);
      for (int h = 0; h < 2; ++h) {
        for (int r = 0; r < R; ++r) {
          const V xv = broadcast(xb[r * p.x_row_stride + 2 * i + h]);
          for (int t = 0; t < T; ++t) acc[r][t] = fmadd(xv, w[h][t], acc[r][t]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r) store_columns(p.y + (row0 + r) * p.y_row_stride + col0, acc[r][t], p.n - col0);
  }
}

// panel[k][tiles * 16]: the exact weights of blocks [block0, block0 + num_blocks) of `tiles`
// consecutive tiles, k-major.
template <Format F>
void dequantize_panel(const Problem& p, int64_t tile0, int tiles, int64_t block0, int64_t num_blocks, float* panel) {
  const int64_t stride = tiles * kTileColumns;
  for (int t = 0; t < tiles; ++t) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const Block<F> block(p.packed + (tile0 + t) * tile_stride<F>(p.k), block0 + b);
      float* out = panel + b * kBlockSize * stride + t * kTileColumns;
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        V w0, w1;
        block.exact_pair(i, w0, w1);
        store(out + 2 * i * stride, w0);
        store(out + (2 * i + 1) * stride, w1);
      }
    }
  }
}

// Rows [row0, row0 + R) x T tiles over k in [k0, k0 + num_k) from a dequantized panel chunk,
// continuing the FMA chains stored in y (exact fp32 round trip) unless k0 == 0.
template <int T, int R>
void panel_rows(const Problem& p, const float* panel, int64_t tile0, int64_t row0, int64_t k0, int64_t num_k) {
  V acc[R][T];
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r)
      acc[r][t] = k0 == 0 ? zero() : load_columns(p.y + (row0 + r) * p.y_row_stride + col0, p.n - col0);
  }
  const float* x = p.x + row0 * p.x_row_stride + k0;
  for (int64_t kk = 0; kk < num_k; ++kk) {
    V w[T];
    for (int t = 0; t < T; ++t) w[t] = load(panel + kk * T * kTileColumns + t * kTileColumns);
    for (int r = 0; r < R; ++r) {
      const V xv = broadcast(x[r * p.x_row_stride + kk]);
      for (int t = 0; t < T; ++t) acc[r][t] = fmadd(xv, w[t], acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r) store_columns(p.y + (row0 + r) * p.y_row_stride + col0, acc[r][t], p.n - col0);
  }
}

using DirectFn = void(const Problem&, int64_t, int64_t);
using PanelFn = void(const Problem&, const float*, int64_t, int64_t, int64_t, int64_t);

template <Format F, int R>
void run_direct(const Problem& p, int64_t tile_begin, int64_t tile_end) {
  constexpr int kTiles = direct_tiles_for(R);
  int64_t tile = tile_begin;
  for (; tile + kTiles <= tile_end; tile += kTiles) direct_tiles<F, R, kTiles>(p, tile, 0);
  for (; tile < tile_end; ++tile) direct_tiles<F, R, 1>(p, tile, 0);
}

template <Format F, int... Rs>
constexpr std::array<DirectFn*, sizeof...(Rs)> direct_table(
    std::integer_sequence<int, Rs...>) {
  return {&run_direct<F, Rs + 1>...};
}
template <int T, int... Rs>
constexpr std::array<PanelFn*, sizeof...(Rs)> panel_table(std::integer_sequence<int, Rs...>) {
  return {&panel_rows<T, Rs + 1>...};
}

template <Format F>
void run_panel(const Problem& p, int64_t tile_begin, int64_t tile_end) {
  static constexpr auto kWide = panel_table<kPanelTiles>(std::make_integer_sequence<int, kPanelRows>{});
  static constexpr auto kNarrow = panel_table<1>(std::make_integer_sequence<int, kPanelRows>{});
  alignas(64) float panel[kChunkBlocks * kBlockSize * kPanelTiles * kTileColumns];
  const int64_t num_blocks = p.k / kBlockSize;
  for (int64_t tile0 = tile_begin; tile0 < tile_end; tile0 += kPanelTiles) {
    const int tiles = static_cast<int>(std::min<int64_t>(kPanelTiles, tile_end - tile0));
    const auto& kernels = tiles == kPanelTiles ? kWide : kNarrow;
    for (int64_t block0 = 0; block0 < num_blocks; block0 += kChunkBlocks) {
      const int64_t chunk = std::min<int64_t>(kChunkBlocks, num_blocks - block0);
      dequantize_panel<F>(p, tile0, tiles, block0, chunk, panel);
      for (int64_t row0 = 0; row0 < p.m; row0 += kPanelRows) {
        const int64_t rows = std::min<int64_t>(kPanelRows, p.m - row0);
        kernels[rows - 1](p, panel, tile0, row0, block0 * kBlockSize, chunk * kBlockSize);
      }
    }
  }
}

template <Format F>
void run_format(const Problem& p, int64_t tile_begin, int64_t tile_end) {
  if (p.m <= kDirectRows) {
    static constexpr auto kDirect = direct_table<F>(std::make_integer_sequence<int, kDirectRows>{});
    kDirect[p.m - 1](p, tile_begin, tile_end);
  } else {
    run_panel<F>(p, tile_begin, tile_end);
  }
}

}  // namespace

int64_t num_tiles(int64_t n) { return (n + kTileColumns - 1) / kTileColumns; }

void run_tiles(const Problem& problem, int64_t tile_begin, int64_t tile_end) {
  with_format(problem.format, [&](auto f) { run_format<decltype(f)::value>(problem, tile_begin, tile_end); });
}

namespace {

// The exact weights of 32-block b of one tile as out[32 k][16 columns], from either packing.
template <Format F, bool kInt8Layout>
void decode_block(const uint8_t* tile, int64_t b, float* out) {
  const Block<F> block(tile, b);
  if constexpr (kInt8Layout) {
    for (int e = 0; e < kBlockSize; ++e) store(out + e * kTileColumns, block.int8_weight(e));
  } else {
    for (int i = 0; i < 16; ++i) {
      V w0, w1;
      block.exact_pair(i, w0, w1);
      store(out + 2 * i * kTileColumns, w0);
      store(out + (2 * i + 1) * kTileColumns, w1);
    }
  }
}

template <bool kInt8Layout>
void dequantize_any(const uint8_t* packed, Format format, int64_t n, int64_t k, float* out, int64_t tile_begin,
                    int64_t tile_end) {
  with_format(format, [&](auto f) {
    constexpr Format F = decltype(f)::value;
    alignas(64) float block[kBlockSize * kTileColumns];
    for (int64_t tile = tile_begin; tile < tile_end; ++tile) {
      const int64_t columns = std::min<int64_t>(kTileColumns, n - tile * kTileColumns);
      for (int64_t b = 0; b < k / kBlockSize; ++b) {
        decode_block<F, kInt8Layout>(packed + tile * tile_stride<F>(k), b, block);
        for (int64_t c = 0; c < columns; ++c)
          for (int e = 0; e < kBlockSize; ++e) out[(tile * kTileColumns + c) * k + b * kBlockSize + e] = block[e * kTileColumns + c];
      }
    }
  });
}

}  // namespace

void dequantize_tiles(const uint8_t* packed, Format format, int64_t n, int64_t k, float* out,
                      int64_t tile_begin, int64_t tile_end) {
  dequantize_any<false>(packed, format, n, k, out, tile_begin, tile_end);
}

void dequantize_tiles_int8(const uint8_t* packed, Format format, int64_t n, int64_t k, float* out,
                           int64_t tile_begin, int64_t tile_end) {
  dequantize_any<true>(packed, format, n, k, out, tile_begin, tile_end);
}

// Decodes the whole 16-column tile-block and keeps one column: the vector decode costs what a
// scalar one of that column would, and it is the matmul's own decoder (hence its exact bits).
void gather_rows(const uint8_t* packed, Format format, bool int8_layout, int64_t n, int64_t k, const int64_t* ids,
                 int64_t row_begin, int64_t row_end, float* out) {
  (void)n;
  with_format(format, [&](auto f) {
    constexpr Format F = decltype(f)::value;
    alignas(64) float block[kBlockSize * kTileColumns];
    for (int64_t row = row_begin; row < row_end; ++row) {
      const uint8_t* tile = packed + ids[row] / kTileColumns * tile_stride<F>(k);
      const int64_t c = ids[row] % kTileColumns;
      for (int64_t b = 0; b < k / kBlockSize; ++b) {
        if (int8_layout)
          decode_block<F, true>(tile, b, block);
        else
          decode_block<F, false>(tile, b, block);
        for (int e = 0; e < kBlockSize; ++e) out[row * k + b * kBlockSize + e] = block[e * kTileColumns + c];
      }
    }
  });
}

const char* isa_name() { return kIsa; }

}  // namespace ifb_quant
