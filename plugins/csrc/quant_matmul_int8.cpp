// Integer-dot block matmul (`--compute int8`): int8 activations x any GGUF block format's weights.
//
// Activations are quantized per row in one of two schemes, chosen by the weights' format:
//
// - 32-weight formats (Q4_0/Q4_1/Q5_x/Q8_0/MXFP4, one weight scale per 32 anyway): per 32-block,
//   like llama.cpp's Q8_1: d = max|x| / 127, q = round-half-even(x / d) in int8, plus the block's
//   integer sum. For one output element and one 32-block the exact integer dot sum(q_w * q_x) is
//   formed with u8 x s8 products (VNNI vpdpbusd, or maddubs + madd without VNNI: both exact, so
//   both give the same integer; u8 values are at most 63, so maddubs' pair sums stay under 2^15),
//   then per block, in fp32:
//
//     Q4_0/Q5_0: acc = fma(float(dot - z * sum_x), d_w * d_x, acc)       (w = (q - z) d_w, z = 8/16)
//     Q8_0:      acc = fma(float(dot), d_w * d_x, acc)                   (w = q d_w)
//     Q4_1/Q5_1: acc = fma(float(dot), d_w * d_x, acc); acc = fma(m_w, d_x * sum_x, acc)
//     MXFP4:     acc = fma(float(dot - 12 sum_x), 2^(e-128) * d_x, acc)   (w = (q - 12) 2^(e-128),
//                q = the code's doubled e2m1 value + 12; the scale product is exact, a power of two)
//
// - K-quants (Q4_K/Q5_K/Q6_K): per 256-weight super-block, like llama.cpp's Q8_K: one d_x per 256,
//   and the integer sums of each 16 and each 32 values. The whole super-block is summed in int32
//   (sub-block scale x sub-block dot, all integers) and the fp32 epilogue runs once per 256:
//
//     Q4_K/Q5_K: S = sum_j sc_j dot_j, M = sum_j m_j sum_x,j   (32-blocks j = 0..7)
//                acc = fma(float(S), d * d_x, acc); acc = fnma(float(M), dmin * d_x, acc)
//     Q6_K:      S = sum_h sc_h (dot_h - 32 sum_x,h)            (16-weight halves h = 0..15)
//                acc = fma(float(S), d * d_x, acc)
//
//   |S| < 2^29 and |M| < 2^21, so the int32 sums never overflow; float(S) is the one rounding of
//   the integer part. Q4_K's dot per 16 weights is below 2^15 (16 x 15 x 127) and takes its scale
//   with a pair-wise int16 multiply-add (vpdpwssd); Q5_K's per 32 and Q6_K's per 16 do not fit in
//   16 bits and take an int32 multiply. M and Q6_K's zero-point sum are int16 pair dots too.
//
// Over blocks (super-blocks) in order, from +0. Every step is per row and per output column, so a
// row's result is bitwise the same whatever else is in the batch, wherever it sits, however many
// threads split the column tiles, and on either ISA path (the integer parts are exact and the fp32
// operations are the same intrinsics in the same order).
//
// The quants come from block_formats.h's Block<F>::int8_group in plugins/quant_ops.py::pack_int8's
// order: per 64-byte group one 4-byte lane per output column, so one load (and a mask, shift and
// bit merge) gives 16 columns x 4 consecutive k per register.
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
// Rows per register block: R x T tiles of fp32 and int32 accumulators plus the tiles' weights.
// Two rows cannot hide the weights' load and unpack, so they take more tiles at once. One row
// (decode) is memory-bound: there, nibble-only formats read best one tile at a time, i.e. the
// packed matrix front to back in one stream (Q4_K 8192x2048 from DRAM, two processes: 44-62 GB/s
// against 28-32 with four tiles at once; a 1B Q4_K_M decode step 26.2 -> 25.2 ms, medians of
// eight alternated runs); formats with high bits (Q5_*, Q6_K) need more work per byte, and one tile
// at a time left them short of the memory (Q6_K 2048x8192: 29-32 GB/s against 36-47).
constexpr int kRows = 4;
template <Format F>
constexpr int tiles_for(int rows) {
  return rows == 1 ? (high_bits<F>() == 0 ? 1 : 4) : rows == 2 ? 4 : 2;
}
#else
constexpr int kRows = 2;
// One row as on AVX-512: the AVX2 build of the one-tile loop read Q4_K 8192x2048 from DRAM at
// 10-16 GB/s against 8-9 with two tiles, Q4_0 10-18 against 8-11 (one thread, this Zen 4 with
// the library built for AVX2, five alternated runs while a test run shared the machine; in
// cache both ran at 23 GB/s).
template <Format F>
constexpr int tiles_for(int rows) {
  return rows == 1 ? (high_bits<F>() == 0 ? 1 : 2) : 1;
}
#endif

// The integer accumulator's start for a block whose activations sum to `sum_x`: it folds the
// zero points of Q4_0 (-8), Q5_0 (-16) and MXFP4 (-12) and the VNNI path's +128 on signed weights into exact
// integer arithmetic.
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

// acc plus one 32-block's term for one row and one tile: `dot` is the block's integer dot, `at`
// the row's block index into x_scales.
template <Format F>
inline V finish_block(const Int8Problem& p, const Block<F>& w, int64_t at, QI dot, V acc) {
  acc = fmadd(to_float(dot), mul(w.scale[0], broadcast(p.x_scales[at])), acc);
  if constexpr (F == Format::kQ4_1 || F == Format::kQ5_1) acc = fmadd(w.offset, broadcast(p.x_scaled_sums[at]), acc);
  return acc;
}

// Rows [row0, row0 + R) x tiles [tile0, tile0 + T), all of K (the 32-weight formats).
template <Format F, int R, int T>
void int8_tiles(const Int8Problem& p, int64_t tile0, int64_t row0) {
  const int64_t num_blocks = p.k / kBlockSize;
  const int64_t stride = tile_stride<F>(p.k);
  // Integer sums are exact, so splitting one into two chains (to hide the dot instruction's
  // latency when few rows share the weights) cannot change a bit.
  constexpr int kChains = R <= 2 ? 2 : 1;
  V acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = zero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    Block<F> blocks[T];
    for (int t = 0; t < T; ++t) blocks[t] = Block<F>(p.packed + (tile0 + t) * stride, b);
    QI dots[kChains][R][T];
    for (int r = 0; r < R; ++r) {
      const QI start = splat(dot_start<F>(p.x_sums[(row0 + r) * p.blocks_row_stride + b]));
      for (int t = 0; t < T; ++t) {
        dots[0][r][t] = start;
        if constexpr (kChains == 2) dots[1][r][t] = splat(0);
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
        for (int r = 0; r < R; ++r) {
          const QI x_lo = splat(load_lane(xb + r * p.xq_row_stride + 8 * g));
          const QI x_hi = splat(load_lane(xb + r * p.xq_row_stride + 8 * g + 4));
          for (int t = 0; t < T; ++t) {
            if constexpr (kPairedDots) {  // (one chain: the int16 sum of both feeds one madd)
              dots[0][r][t] = dot_unsigned2(dots[0][r][t], lo[t], x_lo, hi[t], x_hi);
            } else {
              dots[0][r][t] = dot_unsigned(dots[0][r][t], lo[t], x_lo);
              dots[kChains - 1][r][t] = dot_unsigned(dots[kChains - 1][r][t], hi[t], x_hi);
            }
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < R; ++r) {
        QI dot = dots[0][r][t];
        if constexpr (kChains == 2) dot = add(dot, dots[1][r][t]);
        acc[r][t] = finish_block<F>(p, blocks[t], (row0 + r) * p.blocks_row_stride + b, dot, acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r) store_columns(p.y + (row0 + r) * p.y_row_stride + col0, acc[r][t], p.n - col0);
  }
}

#if defined(IFB_SIMD16_AVX512)
// Many rows: the weight-stationary block. A 32-block's unpacked weights of T tiles (8 x T
// vectors) stay in registers while up to kWideRows rows run their dots against them, one row
// after another; the rows' fp32 sums live in L1 (`sums`), so their loads and stores go to the
// load and store ports, not the two vector ports that the dot instructions, the unpack and the
// epilogue share. Each unpacked weight vector then serves kWideRows rows, not kRows (the 4 x 2
// register block needs all 32 registers for its fp32 and int32 accumulators and weights, and
// 8 x 2 spilled: 20% slower). Per row and tile the operations are the register block's, in the
// same order: the same bits.
constexpr int kWideRows = 8;

template <Format F, int T>
void int8_tiles_wide(const Int8Problem& p, int64_t tile0, int64_t row0) {
  constexpr int R = kWideRows;
  const int64_t num_blocks = p.k / kBlockSize;
  const int64_t stride = tile_stride<F>(p.k);
  alignas(64) float sums[R][T][kTileColumns];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) store(sums[r][t], zero());
  for (int64_t b = 0; b < num_blocks; ++b) {
    Block<F> blocks[T];
    for (int t = 0; t < T; ++t) blocks[t] = Block<F>(p.packed + (tile0 + t) * stride, b);
    QI dots[R][T];
    for (int r = 0; r < R; ++r) {
      const QI start = splat(dot_start<F>(p.x_sums[(row0 + r) * p.blocks_row_stride + b]));
      for (int t = 0; t < T; ++t) dots[r][t] = start;
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
      for (int r = 0; r < R; ++r) {
        const QI x = splat(load_lane(xb + r * p.xq_row_stride + 4 * j));
        for (int t = 0; t < T; ++t) {
          if constexpr (F == Format::kQ8_0) {
            dots[r][t] = dot_signed(dots[r][t], w[t], x);
          } else if constexpr (kPairedDots) {  // lanes j - 1 and j in one step (j odd)
            if (j % 2 == 1) {
              const QI x_lo = splat(load_lane(xb + r * p.xq_row_stride + 4 * (j - 1)));
              dots[r][t] = dot_unsigned2(dots[r][t], previous[t], x_lo, w[t], x);
            }
          } else {
            dots[r][t] = dot_unsigned(dots[r][t], w[t], x);
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
        store(sum, finish_block<F>(p, blocks[t], at, dots[r][t], load(sum)));
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
void wide_block(const Int8Problem& p, int64_t tile0, int64_t tiles, int64_t row0) {
  constexpr int T = 2;
  int64_t tile = tile0;
  for (; tile + T <= tile0 + tiles; tile += T) int8_tiles_wide<F, T>(p, tile, row0);
  for (; tile < tile0 + tiles; ++tile) int8_tiles_wide<F, 1>(p, tile, row0);
}
#endif

// Tiles are walked in groups of kGroupTiles (quant_kernels.h; their weights stay in L2 while
// every row block reads them); within a group each row block takes tiles_for<F>(rows) tiles per call.
template <Format F, int R>
void row_block(const Int8Problem& p, int64_t tile0, int64_t tiles, int64_t row0) {
  constexpr int T = tiles_for<F>(R);
  int64_t tile = tile0;
  for (; tile + T <= tile0 + tiles; tile += T) int8_tiles<F, R, T>(p, tile, row0);
  for (; tile < tile0 + tiles; ++tile) int8_tiles<F, R, 1>(p, tile, row0);
}

using RowBlockFn = void(const Int8Problem&, int64_t, int64_t, int64_t);

template <Format F, int... Rs>
constexpr std::array<RowBlockFn*, sizeof...(Rs)> row_table(std::integer_sequence<int, Rs...>) {
  return {&row_block<F, Rs + 1>...};
}

template <Format F>
void run_format(const Int8Problem& p, int64_t tile_begin, int64_t tile_end) {
  static constexpr auto kBlocks = row_table<F>(std::make_integer_sequence<int, kRows>{});
  for (int64_t tile0 = tile_begin; tile0 < tile_end; tile0 += kGroupTiles) {
    const int64_t tiles = std::min<int64_t>(kGroupTiles, tile_end - tile0);
    for (int64_t row0 = 0; row0 < p.m;) {
      const int64_t left = p.m - row0;
#if defined(IFB_SIMD16_AVX512)
      if (left >= kWideRows) {
        wide_block<F>(p, tile0, tiles, row0);
        row0 += kWideRows;
        continue;
      }
#endif
      kBlocks[std::min<int64_t>(kRows, left) - 1](p, tile0, tiles, row0);
      row0 += std::min<int64_t>(kRows, left);
    }
  }
}

// ---- The super-block scheme (K-quants) ----

constexpr int64_t kSuperBlock = 256;

// One super-block of one tile, its scales decoded as integers once per tile group (every row
// block of the group reads them).
struct SuperScales {
  V d;            // d (fp16, widened)
  V dmin;         // Q4_K/Q5_K: dmin
  QI scale[16];   // Q4_K/Q5_K: sc of 32-block j (j < 8); Q6_K: the int8 scale of 16-weight half h
  QI pairs[8];    // int16 pairs for the sums' term: Q4_K/Q5_K mins m_2i | m_2i+1 << 16 (i < 4);
                  // Q6_K -32 sc_2j | -32 sc_2j+1 << 16 (j < 8): its zero point per 16-weight half
};

inline QI pack_pair(QI first, QI second) { return or_(mask(first, 0xFFFF), slli(second, 16)); }

template <Format F>
SuperScales decode_super(const uint8_t* tile, int64_t s) {
  const uint8_t* base = tile + s * tile_block_bytes<F>();
  SuperScales out;
  out.d = halves(base);
  if constexpr (F == Format::kQ6_K) {
    out.dmin = zero();
    for (int h = 0; h < 16; ++h) out.scale[h] = bytes_signed(base + 32 + 16 * h);
    for (int j = 0; j < 8; ++j)
      out.pairs[j] = pack_pair(mullo(out.scale[2 * j], splat(-32)), mullo(out.scale[2 * j + 1], splat(-32)));
  } else {
    out.dmin = halves(base + 32);
    QI mins[8];
    for (int j = 0; j < 8; ++j) Block<F>::k_quant_scale_min(base, j, out.scale[j], mins[j]);
    for (int i = 0; i < 4; ++i) out.pairs[i] = pack_pair(mins[2 * i], mins[2 * i + 1]);
  }
  return out;
}

// Integer chains per 32-block: Q5_K one per 32 (its dot needs 18 bits either way), Q4_K and Q6_K one
// per 16-weight half (Q4_K's then fits in int16; Q6_K's halves have their own scales).
template <Format F>
constexpr int units_per_block() {
  return F == Format::kQ5_K ? 1 : 2;
}

// acc + scale x chain for unit u of 32-block j, exactly in int32.
template <Format F>
inline QI scale_chain(QI acc, QI chain, const SuperScales& w, int j, int u) {
  if constexpr (F == Format::kQ4_K) return dot_pairs16(acc, chain, w.scale[j]);  // |chain| <= 16 x 15 x 127
  if constexpr (F == Format::kQ5_K) return add(acc, mullo(chain, w.scale[j]));
  return add(acc, mullo(chain, w.scale[2 * j + u]));
}

// Rows [row0, row0 + R) x tiles [tile0, tile0 + T), all of K, in super-blocks. Per 32-block and unit
// the T tiles' unpacked weights stay in registers while the R rows run their dots against them;
// each row's int32 super-block sums stay in registers (R x T of them: kept in L1 instead, their
// loads and stores cost 20% at 512 rows) and its fp32 outputs live in L1 (as int8_tiles_wide's
// sums). `scales`: [tile][super-block] of tiles tile0 onward.
template <Format F, int R, int T>
void super_tiles(const Int8Problem& p, int64_t tile0, int64_t row0, const SuperScales* scales) {
  const int64_t num_super = p.k / kSuperBlock;
  const int64_t stride = tile_stride<F>(p.k);
  constexpr int kUnits = units_per_block<F>();
  constexpr int kGroups = 4 / kUnits;  // int8_group calls (of two 4-k lanes) per unit
  alignas(64) float sums[R][T][kTileColumns];
  QI totals[R][T];  // the rows' int32 super-block sums S
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) store(sums[r][t], zero());
  for (int64_t s = 0; s < num_super; ++s) {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) totals[r][t] = splat(0);
    for (int j = 0; j < 8; ++j) {
      const int64_t b = 8 * s + j;
      Block<F> blocks[T];
      for (int t = 0; t < T; ++t) blocks[t] = Block<F>::quants_of(p.packed + (tile0 + t) * stride, b);
      const int8_t* xb = p.xq + row0 * p.xq_row_stride + b * kBlockSize;
#pragma GCC unroll 2
      for (int u = 0; u < kUnits; ++u) {
        QI lo[T][kGroups], hi[T][kGroups];
        for (int t = 0; t < T; ++t)
          for (int g = 0; g < kGroups; ++g) blocks[t].int8_group(kGroups * u + g, lo[t][g], hi[t][g]);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = xb + r * p.xq_row_stride + 8 * kGroups * u;
          QI chains[T];
          for (int t = 0; t < T; ++t) chains[t] = splat(0);
          for (int g = 0; g < kGroups; ++g) {
            const QI x_lo = splat(load_lane(xr + 8 * g)), x_hi = splat(load_lane(xr + 8 * g + 4));
            for (int t = 0; t < T; ++t) chains[t] = dot_unsigned2(chains[t], lo[t][g], x_lo, hi[t][g], x_hi);
          }
          for (int t = 0; t < T; ++t) {
            totals[r][t] = scale_chain<F>(totals[r][t], chains[t], scales[t * num_super + s], j, u);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      const V d_x = broadcast(p.x_super_scales[row * (p.blocks_row_stride / 8) + s]);
      for (int t = 0; t < T; ++t) {
        const SuperScales& w = scales[t * num_super + s];
        QI total = totals[r][t];
        V acc = load(sums[r][t]);
        if constexpr (F == Format::kQ6_K) {
          const int32_t* halves = p.x_half_pairs + row * p.blocks_row_stride + 8 * s;
          for (int j = 0; j < 8; ++j) total = dot_pairs16(total, w.pairs[j], splat(halves[j]));
          acc = fmadd(to_float(total), mul(w.d, d_x), acc);
        } else {
          const int32_t* subs = p.x_sub_pairs + row * (p.blocks_row_stride / 2) + 4 * s;
          QI mins = splat(0);
          for (int i = 0; i < 4; ++i) mins = dot_pairs16(mins, w.pairs[i], splat(subs[i]));
          acc = fmadd(to_float(total), mul(w.d, d_x), acc);
          acc = fnmadd(to_float(mins), mul(w.dmin, d_x), acc);
        }
        store(sums[r][t], acc);
      }
    }
  }
  __asm__("" ::: "memory");
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r) store_columns(p.y + (row0 + r) * p.y_row_stride + col0, load(sums[r][t]), p.n - col0);
  }
}

// Rows per super-block call: AVX-512's 32 registers hold two tiles' unpacked units while 8 rows
// run; AVX2's 16 hold one tile's.
#if defined(IFB_SIMD16_AVX512)
constexpr int kSuperRows = 8;
constexpr int kSuperTiles = 2;
#else
constexpr int kSuperRows = 4;
constexpr int kSuperTiles = 1;
#endif

template <Format F, int R>
void super_row_block(const Int8Problem& p, int64_t tile0, int64_t tiles, int64_t row0, const SuperScales* scales) {
  // One row (decode) is memory-bound: tiles_for's choice, as the per-32 kernels' (high-bit formats
  // read several tiles at once: Q6_K 1x2048x8192 one tile at a time ran 0.66x the per-32 kernel).
  constexpr int T = R == 1 ? tiles_for<F>(1) : kSuperTiles;
  const int64_t num_super = p.k / kSuperBlock;
  int64_t tile = tile0;
  for (; tile + T <= tile0 + tiles; tile += T) super_tiles<F, R, T>(p, tile, row0, scales + (tile - tile0) * num_super);
  for (; tile < tile0 + tiles; ++tile) super_tiles<F, R, 1>(p, tile, row0, scales + (tile - tile0) * num_super);
}

using SuperBlockFn = void(const Int8Problem&, int64_t, int64_t, int64_t, const SuperScales*);

template <Format F, int... Rs>
constexpr std::array<SuperBlockFn*, sizeof...(Rs)> super_table(std::integer_sequence<int, Rs...>) {
  return {&super_row_block<F, Rs + 1>...};
}

template <Format F>
void run_super(const Int8Problem& p, int64_t tile_begin, int64_t tile_end) {
  static constexpr auto kBlocks = super_table<F>(std::make_integer_sequence<int, kSuperRows>{});
  const int64_t num_super = p.k / kSuperBlock;
  const int64_t stride = tile_stride<F>(p.k);
  std::vector<SuperScales> scales(static_cast<size_t>(kGroupTiles * num_super));
  for (int64_t tile0 = tile_begin; tile0 < tile_end; tile0 += kGroupTiles) {
    const int64_t tiles = std::min<int64_t>(kGroupTiles, tile_end - tile0);
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t s = 0; s < num_super; ++s) scales[t * num_super + s] = decode_super<F>(p.packed + (tile0 + t) * stride, s);
    for (int64_t row0 = 0; row0 < p.m;) {
      const int64_t rows = std::min<int64_t>(kSuperRows, p.m - row0);
      kBlocks[rows - 1](p, tile0, tiles, row0, scales.data());
      row0 += rows;
    }
  }
}

// Per 256 values of one row: d = max|x| / 127 and q as quantize_rows_int8's per-32 scheme, the
// sums of each 16 q as int16 pairs per 32, and the 32-sums as pairs per 64.
void quantize_row_super(const float* x, int64_t k, int64_t row, const Int8Activations& out) {
  const int64_t num_blocks = k / kBlockSize;
  for (int64_t s = 0; s < k / kSuperBlock; ++s) {
    const float* xs = x + s * kSuperBlock;
    V peak = zero();
    for (int i = 0; i < kSuperBlock / kLanes; ++i) peak = max(peak, abs_(load(xs + kLanes * i)));
    const float d = max_lanes(peak) / 127.0f;
    const V inverse = broadcast(d != 0.0f ? 1.0f / d : 0.0f);
    out.x_super_scales[row * (num_blocks / 8) + s] = d;
    int32_t block_sums[8];
    for (int j = 0; j < 8; ++j) {
      int32_t half[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t at = s * kSuperBlock + kBlockSize * j + kLanes * h;
        const QI q = to_int(mul(load(x + at), inverse));
        store_int8(out.xq + row * out.xq_row_stride + at, q);
        half[h] = sum_int_lanes(q);
      }
      out.x_half_pairs[row * num_blocks + 8 * s + j] = (half[0] & 0xFFFF) | static_cast<int32_t>(static_cast<uint32_t>(half[1]) << 16);
      block_sums[j] = half[0] + half[1];
    }
    for (int i = 0; i < 4; ++i)
      out.x_sub_pairs[row * (num_blocks / 2) + 4 * s + i] =
          (block_sums[2 * i] & 0xFFFF) | static_cast<int32_t>(static_cast<uint32_t>(block_sums[2 * i + 1]) << 16);
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
    if (out.x_super_scales != nullptr) {
      quantize_row_super(x + row * x_row_stride, k, row, out);
      continue;
    }
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
  with_format(problem.format, [&](auto f) {
    constexpr Format kFormat = decltype(f)::value;
    if constexpr (is_k_quant<kFormat>())
      run_super<kFormat>(problem, tile_begin, tile_end);
    else
      run_format<kFormat>(problem, tile_begin, tile_end);
  });
}

const char* int8_dot_path() { return kDotPath; }

}  // namespace ifb_quant
