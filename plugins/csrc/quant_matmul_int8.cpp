// Integer-dot block matmul (`--compute int8`): int8 activations x any GGUF block format's weights.
//
// Each row of x is quantized per 32-element block, like llama.cpp's Q8_1: d = max|x| / 127,
// q = round-half-even(x / d) in int8, plus the block's integer sum (and its two 16-halves' sums).
// For one output element and one 32-weight (sub-)block, the exact integer dot sum(q_w * q_x) is
// formed with u8 x s8 products (VNNI vpdpbusd, or maddubs + madd without VNNI: both exact, so both
// give the same integer; u8 values are at most 63, so maddubs' pair sums stay under 2^15), then
//
//   Q4_0/Q5_0: acc = fma(float(dot - z * sum_x), d_w * d_x, acc)         (w = (q - z) d_w, z = 8/16)
//   Q8_0:      acc = fma(float(dot), d_w * d_x, acc)                     (w = q d_w)
//   Q4_1/Q5_1: acc = fma(float(dot), d_w * d_x, acc); acc = fma(m_w, d_x * sum_x, acc)
//   Q4_K/Q5_K: acc = fma(float(dot), (d sc) * d_x, acc); acc = fnma(dmin m, d_x * sum_x, acc)
//   MXFP4:     acc = fma(float(dot - 12 sum_x), 2^(e-128) * d_x, acc)     (w = (q - 12) 2^(e-128),
//              q = the code's doubled e2m1 value + 12; the scale product is exact, a power of two)
//   Q6_K:      acc = fma(float(sc0 (dot0 - 32 s0) + sc1 (dot1 - 32 s1)), d * d_x, acc)
//              (dot_h, s_h over the 16-weight halves, each with its int8 scale; exact in int32)
//
// over blocks b = 0, 1, ... in order, from +0. Every step is per row and per output column, so a
// row's result is bitwise the same whatever else is in the batch, wherever it sits, however many
// threads split the column tiles, and on either ISA path (the integer part is exact and the fp32
// operations are the same intrinsics). The integers are exact in fp32 (all below 2^24).
//
// The quants come from block_formats.h's Block<F>::int8_group in plugins/quant_ops.py::pack_int8's
// order: per 64-byte group one 4-byte lane per output column, so one load (and a mask, shift and
// bit merge) gives 16 columns x 4 consecutive k per register.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "block_formats.h"
#include "quant_kernels.h"

namespace ifb_quant {
namespace {

#if defined(IFB_SIMD16_AVX512)
// Rows per register block: R x T tiles of fp32 and int32 accumulators plus the tiles' weights.
// Two rows cannot hide the weights' load and unpack, so they take more tiles at once.
constexpr int kRows = 4;
template <Format F>
constexpr int tiles_for(int rows) {
  return rows == 2 ? 4 : 2;  // rows >= 2 (one row: one_row_tiles)
}
// One row (decode) is memory-bound, and how many tiles its pass should stream at once depends on the
// CPU. Formats with high bits (Q5_*, Q6_K) need more work per byte and take four everywhere (Q6_K
// 2048x8192 on an AMD EPYC: 29-32 GB/s one tile at a time against 36-47). For the nibble formats and
// Q8_0 the CPUs disagree: on an AMD EPYC (Zen 4) one tile at a time, the packed matrix front to
// back in one stream, read best (Q4_K 8192x2048 from DRAM, two processes: 44-62 GB/s against 28-32
// with four; a 1B Q4_K_M decode step 26.2 -> 25.2 ms, medians of eight alternated runs); on an
// Intel Xeon (AVX-512 VNNI + AMX) four read best (one row from DRAM, 2 threads, medians of 40, two
// alternated runs: Q4_K 12288x2048 0.70 against 0.93 ms, Q4_1 0.66 / 0.87, Q4_0 0.57 / 0.74, Q8_0
// 8192x2048 0.63 / 0.73). The tile count never changes a bit: each tile's arithmetic is the same.
constexpr int kWideOneRowTiles = 4;
#else
constexpr int kRows = 2;
template <Format F>
constexpr int tiles_for(int rows) {
  return 1;  // rows >= 2 (one row: one_row_tiles)
}
// One row as on AVX-512, by CPU: the AVX2 build of the one-tile loop read Q4_K 8192x2048 from DRAM
// at 10-16 GB/s against 8-9 with two tiles, Q4_0 10-18 against 8-11 on an AMD EPYC (Zen 4, one
// thread, five alternated runs while a test run shared the machine; in cache both ran at 23
// GB/s); on the Intel Xeon two read best (2 threads, medians of 40, two alternated runs: Q4_K
// 12288x2048 0.87 against 1.00 ms, Q4_1 0.81 / 0.95, Q4_0 0.72 / 0.84, Q8_0 8192x2048 0.72 / 0.88).
constexpr int kWideOneRowTiles = 2;
#endif

// The one-row tile count set for nibble formats and Q8_0 (set_one_row_tiles), 0 = the CPU's:
// 1 on AMD CPUs, kWideOneRowTiles on others.
std::atomic<int> g_one_row_tiles{0};

int default_one_row_tiles() {
  static const int tiles = __builtin_cpu_is("amd") ? 1 : kWideOneRowTiles;
  return tiles;
}

int current_one_row_tiles() {
  const int set = g_one_row_tiles.load(std::memory_order_relaxed);
  return set != 0 ? set : default_one_row_tiles();
}

// Q6_K's integer accumulators of a block start at -32 x the sum of their 16-weight half's
// activations: that is its zero point (w = sc (q - 32) d), folded into exact integers.
inline void q6_k_start(const Int8Problem& p, int64_t at, QI& first, QI& second) {
  first = splat(-32 * p.x_half_sums[2 * at]);
  second = splat(-32 * p.x_half_sums[2 * at + 1]);
}

// The integer accumulator's start for a block whose activations sum to `sum_x`: it folds the
// zero points of Q4_0 (-8), Q5_0 (-16) and MXFP4 (-12) and the VNNI path's +128 on signed weights into exact
// integer arithmetic. (Q6_K's -32 is applied per 16-weight half, with its scales.)
template <Format F>
inline int32_t dot_start(int32_t sum_x) {
  if constexpr (F == Format::kQ4_0) return -8 * sum_x;
  if constexpr (F == Format::kQ5_0) return -16 * sum_x;
  if constexpr (F == Format::kMXFP4) return -kMxfp4Zero * sum_x;
  if constexpr (F == Format::kQ8_0) return -kSignedOffset * sum_x;
  return 0;
}

inline int32_t load_lane(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_columns(float* dst, V v, int64_t valid) {
  if (valid >= kTileColumns) {
    store(dst, v);
    return;
  }
  alignas(64) float tmp[kTileColumns];
  store(tmp, v);
  std::memcpy(dst, tmp, static_cast<size_t>(valid) * sizeof(float));
}

// Q4_K/Q5_K scales and offsets decoded once per tile group (see run_format): [tile][block][2].
template <Format F>
constexpr bool caches_scales() {
  return F == Format::kQ4_K || F == Format::kQ5_K;
}

// acc plus one 32-block's term for one row and one tile: `dot` is the block's integer dot (Q6_K: of
// the first 16-weight half, `second` of the other), `at` the row's block index into x_scales.
template <Format F>
inline V finish_block(const Int8Problem& p, const Block<F>& w, int64_t at, QI dot, QI second, V acc) {
  if constexpr (F == Format::kQ6_K) {
    // sc0 (dot0 - 32 s0) + sc1 (dot1 - 32 s1), the dots having started at -32 s (q6_k_start):
    // |dot_h - 32 s_h| <= 16 * 32 * 127 and |sc| <= 128, so both products and their sum are
    // integers below 2^24 (<= 2 * 128 * 16 * 32 * 127), exact in fp32: the one rounding of the
    // fma is no rounding, and this is the int32 sum's value (its int32 mullo cost 2 uops each).
    const V sum = fmadd(to_float(dot), w.float_scale[0], mul(to_float(second), w.float_scale[1]));
    return fmadd(sum, mul(w.d, broadcast(p.x_scales[at])), acc);
  } else {
    acc = fmadd(to_float(dot), mul(w.scale[0], broadcast(p.x_scales[at])), acc);
    if constexpr (F == Format::kQ4_1 || F == Format::kQ5_1) acc = fmadd(w.offset, broadcast(p.x_scaled_sums[at]), acc);
    if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) acc = fnmadd(w.offset, broadcast(p.x_scaled_sums[at]), acc);
    return acc;
  }
}

// The decoded Block<F> of 32-block b of a tile (see int8_tiles' `scales`).
template <Format F>
inline Block<F> tile_block(const uint8_t* tile, int64_t b, const V* scales, int64_t num_blocks, int t) {
  if constexpr (caches_scales<F>()) {
    if (scales != nullptr) {
      const V* decoded = scales + 2 * (t * num_blocks + b);
      return Block<F>::with_scales(tile, b, decoded[0], decoded[1]);
    }
  }
  return Block<F>(tile, b);
}

// Rows [row0, row0 + R) x tiles [tile0, tile0 + T), all of K. `scales`: the decoded scales of
// tile0 onward (caches_scales formats, many rows), or null to decode them here.
template <Format F, int R, int T>
void int8_tiles(const Int8Problem& p, int64_t tile0, int64_t row0, const V* scales) {
  const int64_t num_blocks = p.k / kBlockSize;
  const int64_t stride = tile_stride<F>(p.k);
  // Integer sums are exact, so splitting one into two chains (to hide the dot instruction's
  // latency when few rows share the weights) cannot change a bit. Q6_K needs the two 16-weight
  // halves apart anyway: they have their own scales.
  constexpr bool kSplitHalves = F == Format::kQ6_K;
  constexpr int kChains = kSplitHalves || R <= 2 ? 2 : 1;
  V acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = zero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    Block<F> blocks[T];
    for (int t = 0; t < T; ++t) blocks[t] = tile_block<F>(p.packed + (tile0 + t) * stride, b, scales, num_blocks, t);
    QI dots[kChains][R][T];
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * p.blocks_row_stride + b;
      QI start = splat(dot_start<F>(p.x_sums[at])), second = splat(0);
      if constexpr (F == Format::kQ6_K) q6_k_start(p, at, start, second);
      for (int t = 0; t < T; ++t) {
        dots[0][r][t] = start;
        if constexpr (kChains == 2) dots[1][r][t] = second;
      }
    }
    const int8_t* xb = p.xq + row0 * p.xq_row_stride + b * kBlockSize;
    if constexpr (F == Format::kQ8_0) {
      for (int g = 0; g < 8; ++g) {
        QI w[T];
        for (int t = 0; t < T; ++t) w[t] = load_bytes(blocks[t].quants + 64 * g);
        for (int r = 0; r < R; ++r) {
          const QI x = splat(load_lane(xb + r * p.xq_row_stride + 4 * g));
          for (int t = 0; t < T; ++t) dots[g % kChains][r][t] = dot_signed(dots[g % kChains][r][t], w[t], x);
        }
      }
    } else {
      // Unrolled: each group's bit positions (and whether to shift at all) become constants.
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        QI lo[T], hi[T];
        for (int t = 0; t < T; ++t) blocks[t].int8_group(g, lo[t], hi[t]);
        const int lo_chain = kSplitHalves ? g / 2 : 0;
        const int hi_chain = kSplitHalves ? g / 2 : kChains - 1;
        for (int r = 0; r < R; ++r) {
          const QI x_lo = splat(load_lane(xb + r * p.xq_row_stride + 8 * g));
          const QI x_hi = splat(load_lane(xb + r * p.xq_row_stride + 8 * g + 4));
          for (int t = 0; t < T; ++t) {
            if constexpr (kPairedDots) {  // (one chain: the int16 sum of both feeds one madd)
              dots[lo_chain][r][t] = dot_unsigned2(dots[lo_chain][r][t], lo[t], x_lo, hi[t], x_hi);
            } else {
              dots[lo_chain][r][t] = dot_unsigned(dots[lo_chain][r][t], lo[t], x_lo);
              dots[hi_chain][r][t] = dot_unsigned(dots[hi_chain][r][t], hi[t], x_hi);
            }
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < R; ++r) {
        QI dot = dots[0][r][t];
        if constexpr (kChains == 2 && !kSplitHalves) dot = add(dot, dots[1][r][t]);
        acc[r][t] = finish_block<F>(p, blocks[t], (row0 + r) * p.blocks_row_stride + b, dot, dots[kChains - 1][r][t], acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r) store_columns(p.y + (row0 + r) * p.y_row_stride + col0, acc[r][t], p.n - col0);
  }
}

// Many rows: the weight-stationary block. A 32-block's unpacked weights of T tiles (8 x T
// vectors) stay in registers while up to kWideRows rows run their dots against them, one row
// after another; the rows' fp32 sums live in L1 (`sums`), so their loads and stores go to the
// load and store ports, not the two vector ports that the dot instructions, the unpack and the
// epilogue share. Each unpacked weight vector then serves kWideRows rows, not kRows (the 4 x 2
// register block needs all 32 registers for its fp32 and int32 accumulators and weights, and
// 8 x 2 spilled: 20% slower). On AVX2 (16 registers, two per vector) the block is 4 rows x 1 tile
// against the register block's 2 x 1: one thread, an AMD EPYC with AVX2 only, best of 20 alternated
// calls, Llama-3.2-1B's shapes: 512 rows Q4_K +11%, Q6_K +24%, SmolLM2's Q4_1 +10%; 4-16 rows Q4_K
// +5-24%, Q6_K +29-31%. Per row and tile the operations are the register block's, in the same
// order (and the maddubs paths pair the same two lanes): the same bits.
#if defined(IFB_SIMD16_AVX512)
constexpr int kWideRows = 8, kWideTiles = 2;
#else
constexpr int kWideRows = 4, kWideTiles = 1;
#endif

template <Format F, int T>
void int8_tiles_wide(const Int8Problem& p, int64_t tile0, int64_t row0, const V* scales) {
  constexpr int R = kWideRows;
  const int64_t num_blocks = p.k / kBlockSize;
  const int64_t stride = tile_stride<F>(p.k);
  constexpr bool kSplitHalves = F == Format::kQ6_K;
  constexpr int kChains = kSplitHalves ? 2 : 1;
  alignas(64) float sums[R][T][kTileColumns];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) store(sums[r][t], zero());
  for (int64_t b = 0; b < num_blocks; ++b) {
    Block<F> blocks[T];
    for (int t = 0; t < T; ++t) blocks[t] = tile_block<F>(p.packed + (tile0 + t) * stride, b, scales, num_blocks, t);
    QI dots[kChains][R][T];
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * p.blocks_row_stride + b;
      QI start = splat(dot_start<F>(p.x_sums[at])), second = splat(0);
      if constexpr (F == Format::kQ6_K) q6_k_start(p, at, start, second);
      for (int t = 0; t < T; ++t) {
        dots[0][r][t] = start;
        if constexpr (kChains == 2) dots[1][r][t] = second;
      }
    }
    const int8_t* xb = p.xq + row0 * p.xq_row_stride + b * kBlockSize;
    QI previous[T];  // the maddubs paths pair lane j - 1's weights with lane j's
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // per column the 4 weights of k = 4j .. 4j + 3, as the activations' lane j
      QI w[T];
      for (int t = 0; t < T; ++t) {
        if constexpr (F == Format::kQ8_0) {
          w[t] = load_bytes(blocks[t].quants + 64 * j);
        } else {
          QI lo, hi;
          blocks[t].int8_group(j / 2, lo, hi);  // (the compiler merges the two calls per group)
          w[t] = j % 2 == 0 ? lo : hi;
        }
      }
      const int chain = kSplitHalves ? j / 4 : 0;  // Q6_K: the 16-weight halves apart (own scales)
      for (int r = 0; r < R; ++r) {
        const QI x = splat(load_lane(xb + r * p.xq_row_stride + 4 * j));
        for (int t = 0; t < T; ++t) {
          if constexpr (F == Format::kQ8_0) {
            dots[chain][r][t] = dot_signed(dots[chain][r][t], w[t], x);
          } else if constexpr (kPairedDots) {  // lanes j - 1 and j in one step (j odd), same chain
            if (j % 2 == 1) {
              const QI x_lo = splat(load_lane(xb + r * p.xq_row_stride + 4 * (j - 1)));
              dots[chain][r][t] = dot_unsigned2(dots[chain][r][t], previous[t], x_lo, w[t], x);
            }
          } else {
            dots[chain][r][t] = dot_unsigned(dots[chain][r][t], w[t], x);
          }
        }
      }
      for (int t = 0; t < T; ++t) previous[t] = w[t];
    }
    // The sums' address made opaque to the compiler each block: otherwise gcc keeps all 16 in
    // registers across blocks and spills the dots instead (measured: slower than 4 x 2).
    float* in_l1 = &sums[0][0][0];
    __asm__("" : "+r"(in_l1));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * p.blocks_row_stride + b;
      for (int t = 0; t < T; ++t) {
        float* sum = in_l1 + (r * T + t) * kTileColumns;
        store(sum, finish_block<F>(p, blocks[t], at, dots[0][r][t], dots[kChains - 1][r][t], load(sum)));
      }
    }
  }
  __asm__("" ::: "memory");  // (the stores through in_l1 land before these loads)
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r) store_columns(p.y + (row0 + r) * p.y_row_stride + col0, load(sums[r][t]), p.n - col0);
  }
}

template <Format F>
void wide_block(const Int8Problem& p, int64_t tile0, int64_t tiles, int64_t row0, const V* scales) {
  // Q6_K's two chains per row and tile (its 16-weight halves) take 8 x 2 x 2 registers: one tile.
  constexpr int T = F == Format::kQ6_K ? 1 : kWideTiles;
  const int64_t per_tile = 2 * (p.k / kBlockSize);
  const auto at = [&](int64_t tile) { return scales == nullptr ? nullptr : scales + (tile - tile0) * per_tile; };
  int64_t tile = tile0;
  for (; tile + T <= tile0 + tiles; tile += T) int8_tiles_wide<F, T>(p, tile, row0, at(tile));
  for (; tile < tile0 + tiles; ++tile) int8_tiles_wide<F, 1>(p, tile, row0, at(tile));
}

// Tiles are walked in groups of kGroupTiles (quant_kernels.h; their weights stay in L2 while
// every row block reads them); within a group each row block takes tiles_for<F>(rows) tiles per call.
//
// From this many rows a group's Q4_K/Q5_K scales are decoded once into a buffer and every row
// block loads them: decoding is ~12 vector ops per tile and sub-block, which a 4-row block
// otherwise repeats for its 64 dot instructions (Q4_K 4096x2048, one core: +11% at 512 rows,
// +6% at 64; the median of 7 alternated runs each).
constexpr int64_t kScaleCacheRows = 8;

template <Format F, int R, int T>
void row_block_of(const Int8Problem& p, int64_t tile0, int64_t tiles, int64_t row0, const V* scales) {
  const int64_t per_tile = 2 * (p.k / kBlockSize);
  const auto at = [&](int64_t tile) { return scales == nullptr ? nullptr : scales + (tile - tile0) * per_tile; };
  int64_t tile = tile0;
  for (; tile + T <= tile0 + tiles; tile += T) int8_tiles<F, R, T>(p, tile, row0, at(tile));
  for (; tile < tile0 + tiles; ++tile) int8_tiles<F, R, 1>(p, tile, row0, at(tile));
}

template <Format F, int R>
void row_block(const Int8Problem& p, int64_t tile0, int64_t tiles, int64_t row0, const V* scales) {
  if constexpr (R > 1) {
    row_block_of<F, R, tiles_for<F>(R)>(p, tile0, tiles, row0, scales);
  } else if (high_bits<F>() > 0 || current_one_row_tiles() > 1) {
    row_block_of<F, 1, kWideOneRowTiles>(p, tile0, tiles, row0, scales);
  } else {
    row_block_of<F, 1, 1>(p, tile0, tiles, row0, scales);
  }
}

using RowBlockFn = void(const Int8Problem&, int64_t, int64_t, int64_t, const V*);

template <Format F, int... Rs>
constexpr std::array<RowBlockFn*, sizeof...(Rs)> row_table(std::integer_sequence<int, Rs...>) {
  return {&row_block<F, Rs + 1>...};
}

// The scale and offset of every sub-block of tiles [tile0, tile0 + tiles), as Block<F> decodes them.
template <Format F>
void decode_scales(const Int8Problem& p, int64_t tile0, int64_t tiles, V* out) {
  const int64_t num_blocks = p.k / kBlockSize;
  const int64_t stride = tile_stride<F>(p.k);
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const Block<F> block(p.packed + (tile0 + t) * stride, b);
      out[2 * (t * num_blocks + b)] = block.scale[0];
      out[2 * (t * num_blocks + b) + 1] = block.offset;
    }
  }
}

template <Format F>
void run_format(const Int8Problem& p, int64_t tile_begin, int64_t tile_end) {
  static constexpr auto kBlocks = row_table<F>(std::make_integer_sequence<int, kRows>{});
  std::vector<V> scales;
  const bool cache = caches_scales<F>() && p.m >= kScaleCacheRows;
  if (cache) scales.resize(static_cast<size_t>(2 * kGroupTiles * (p.k / kBlockSize)));
  for (int64_t tile0 = tile_begin; tile0 < tile_end; tile0 += kGroupTiles) {
    const int64_t tiles = std::min<int64_t>(kGroupTiles, tile_end - tile0);
    if (cache) decode_scales<F>(p, tile0, tiles, scales.data());
    const V* decoded = cache ? scales.data() : nullptr;
    for (int64_t row0 = 0; row0 < p.m;) {
      const int64_t left = p.m - row0;
      if (left >= kWideRows) {
        wide_block<F>(p, tile0, tiles, row0, decoded);
        row0 += kWideRows;
        continue;
      }
      kBlocks[std::min<int64_t>(kRows, left) - 1](p, tile0, tiles, row0, decoded);
      row0 += std::min<int64_t>(kRows, left);
    }
  }
}

}  // namespace

void quantize_rows_int8(const float* x, int64_t x_row_stride, int64_t k, int64_t row_begin, int64_t row_end,
                        const Int8Activations& out) {
  // Vectorized, with the scalar definition's exact bits: max is exact in any order, d and 1/d are
  // the same scalar operations, x * (1/d) the same IEEE product per lane, cvtps rounds half to
  // even as nearbyint does under the default mode, and integer sums are exact. (The scalar loop
  // was ~1 ns per value: 17% of SmolLM2's int8 matmul time at 512 rows, one thread.)
  static_assert(kBlockSize == 2 * kLanes, "a 32-block is two vectors");
  const int64_t num_blocks = k / kBlockSize;
  for (int64_t row = row_begin; row < row_end; ++row) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + row * x_row_stride + b * kBlockSize;
      const V first = load(xb), second = load(xb + kLanes);
      const float d = max_lanes(max(abs_(first), abs_(second))) / 127.0f;
      const V inverse = broadcast(d != 0.0f ? 1.0f / d : 0.0f);
      const QI q0 = to_int(mul(first, inverse)), q1 = to_int(mul(second, inverse));
      int8_t* q = out.xq + row * out.xq_row_stride + b * kBlockSize;
      store_int8(q, q0);
      store_int8(q + kLanes, q1);
      const int64_t at = row * out.blocks_row_stride + b;
      const int32_t half0 = sum_int_lanes(q0), half1 = sum_int_lanes(q1), sum = half0 + half1;
      out.x_scales[at] = d;
      out.x_sums[at] = sum;
      out.x_scaled_sums[at] = d * static_cast<float>(sum);
      out.x_half_sums[2 * at] = half0;
      out.x_half_sums[2 * at + 1] = half1;
    }
  }
}

void run_tiles_int8(const Int8Problem& problem, int64_t tile_begin, int64_t tile_end) {
  with_format(problem.format, [&](auto f) { run_format<decltype(f)::value>(problem, tile_begin, tile_end); });
}

const char* int8_dot_path() { return kDotPath; }

int one_row_tiles() { return current_one_row_tiles(); }

int wide_one_row_tiles() { return kWideOneRowTiles; }

bool set_one_row_tiles(int tiles) {
  if (tiles != 0 && tiles != 1 && tiles != kWideOneRowTiles) return false;
  g_one_row_tiles.store(tiles, std::memory_order_relaxed);
  return true;
}

}  // namespace ifb_quant
