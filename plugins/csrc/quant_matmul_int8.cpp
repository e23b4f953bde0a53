// Integer-dot block matmul (`--compute int8`): int8 activations x Q4_0/Q4_1/Q8_0 weights.
//
// Each row of x is quantized per 32-element block, like llama.cpp's Q8_1: d = max|x| / 127,
// q = round-half-even(x / d) in int8, plus the block's integer sum. For one output element and
// one block, the exact integer dot sum(w_q * x_q) is formed with u8 x s8 products (VNNI
// vpdpbusd, or maddubs + madd without VNNI: both exact, so both give the same integer), then
//
//   Q4_0: acc = fma(float(dot - 8 * sum_x), d_w * d_x, acc)              (w = (q - 8) d_w)
//   Q8_0: acc = fma(float(dot), d_w * d_x, acc)                          (w = q d_w)
//   Q4_1: acc = fma(float(dot), d_w * d_x, acc); acc = fma(m_w, d_x * sum_x, acc)
//
// over blocks b = 0, 1, ... in order, from +0. Every step is per row and per output column, so a
// row's result is bitwise the same whatever else is in the batch, wherever it sits, however many
// threads split the column tiles, and on either ISA path (the integer part is exact and the fp32
// operations are the same intrinsics). The integers are exact in fp32 (|dot| < 2^17).
//
// Packed tile-block for this mode (same sizes as quant_matmul.cpp's, built by
// plugins/quant_ops.py::pack_int8): the fp16 scales as there, then the quants in groups of 64
// bytes, one 4-byte lane per output column j:
//   Q4_x: group g = 0..3, lane j byte b: w[8g + b] | w[8g + 4 + b] << 4   (unsigned nibbles)
//   Q8_0: group g = 0..7, lane j byte b: w[4g + b]                        (int8)
// so one 64-byte load and a mask/shift give 16 columns x 4 consecutive k per register.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "quant_kernels.h"

namespace ifb_quant {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
struct V {
  __m512 a;
};
struct QI {
  __m512i a;
};
inline V zero() { return {_mm512_setzero_ps()}; }
inline V broadcast(float x) { return {_mm512_set1_ps(x)}; }
inline V fmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.a, b.a, c.a)}; }
inline V mul(V a, V b) { return {_mm512_mul_ps(a.a, b.a)}; }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v.a); }
inline V halves(const uint8_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline QI load_bytes(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline QI splat(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline QI low_nibbles(QI q) { return {_mm512_and_si512(q.a, _mm512_set1_epi8(15))}; }
inline QI high_nibbles(QI q) { return {_mm512_and_si512(_mm512_srli_epi16(q.a, 4), _mm512_set1_epi8(15))}; }
inline V to_float(QI q) { return {_mm512_cvtepi32_ps(q.a)}; }
inline QI add(QI a, QI b) { return {_mm512_add_epi32(a.a, b.a)}; }

#if defined(__AVX512VNNI__)
constexpr const char* kDotPath = "vnni";
// Signed weights go in as w + 128 (vpdpbusd's first operand is unsigned); the accumulator starts
// at -128 * sum_x, which is exact.
constexpr int32_t kSignedOffset = 128;
inline QI dot_unsigned(QI acc, QI w, QI x) { return {_mm512_dpbusd_epi32(acc.a, w.a, x.a)}; }
inline QI dot_signed(QI acc, QI w, QI x) {
  return {_mm512_dpbusd_epi32(acc.a, _mm512_xor_si512(w.a, _mm512_set1_epi8(-128)), x.a)};
}
#else
constexpr const char* kDotPath = "maddubs";
constexpr int32_t kSignedOffset = 0;
// Pairs of u8 x s8 products sum to at most 2 * 15 * 127 (Q4) or 2 * 128 * 127 (sign trick
// below): maddubs never saturates, so the int32 total is exact.
inline QI dot_unsigned(QI acc, QI w, QI x) {
  const __m512i pairs = _mm512_maddubs_epi16(w.a, x.a);
  return {_mm512_add_epi32(acc.a, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
inline QI dot_signed(QI acc, QI w, QI x) {
  const __m512i x_signed = _mm512_mask_sub_epi8(x.a, _mm512_movepi8_mask(w.a), _mm512_setzero_si512(), x.a);
  return dot_unsigned(acc, {_mm512_abs_epi8(w.a)}, {x_signed});
}
#endif
// Rows per register block: R x T tiles of fp32 and int32 accumulators plus the tiles' weights.
// One or two rows cannot hide the weights' load and unpack, so they take more tiles at once.
constexpr int kRows = 4;
constexpr int tiles_for(int rows) { return rows <= 2 ? 4 : 2; }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct V {
  __m256 lo, hi;
};
struct QI {
  __m256i lo, hi;
};
inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V broadcast(float x) {
  const __m256 b = _mm256_set1_ps(x);
  return {b, b};
}
inline V fmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline void store(float* p, V v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V halves(const uint8_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline QI load_bytes(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline QI splat(int32_t x) {
  const __m256i b = _mm256_set1_epi32(x);
  return {b, b};
}
inline QI low_nibbles(QI q) {
  const __m256i mask = _mm256_set1_epi8(15);
  return {_mm256_and_si256(q.lo, mask), _mm256_and_si256(q.hi, mask)};
}
inline QI high_nibbles(QI q) {
  const __m256i mask = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi16(q.lo, 4), mask), _mm256_and_si256(_mm256_srli_epi16(q.hi, 4), mask)};
}
inline V to_float(QI q) { return {_mm256_cvtepi32_ps(q.lo), _mm256_cvtepi32_ps(q.hi)}; }
inline QI add(QI a, QI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }

constexpr const char* kDotPath = "maddubs";
constexpr int32_t kSignedOffset = 0;
inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
inline QI dot_unsigned(QI acc, QI w, QI x) { return {dot8(acc.lo, w.lo, x.lo), dot8(acc.hi, w.hi, x.hi)}; }
inline QI dot_signed(QI acc, QI w, QI x) {
  return {dot8(acc.lo, _mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(x.lo, w.lo)),
          dot8(acc.hi, _mm256_sign_epi8(w.hi, w.hi), _mm256_sign_epi8(x.hi, w.hi))};
}
constexpr int kRows = 2;
constexpr int tiles_for(int rows) { return rows == 1 ? 2 : 1; }

#else
#error "quant_matmul_int8.cpp needs -mavx512f -mavx512bw -mavx512vl or -mavx2 -mfma -mf16c"
#endif

template <Format F>
constexpr int64_t tile_block_bytes() {
  return (F == Format::kQ4_0 ? 18 : F == Format::kQ4_1 ? 20 : 34) * kTileColumns;
}

template <Format F>
constexpr int64_t scale_bytes() {
  return F == Format::kQ4_1 ? 64 : 32;
}

// The integer accumulator's start for a block whose activations sum to `sum_x`: it folds Q4_0's
// -8 zero point and the VNNI path's +128 on signed weights into exact integer arithmetic.
template <Format F>
inline int32_t dot_start(int32_t sum_x) {
  if constexpr (F == Format::kQ4_0) return -8 * sum_x;
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

// Rows [row0, row0 + R) x tiles [tile0, tile0 + T), all of K.
template <Format F, int R, int T>
void int8_tiles(const Int8Problem& p, int64_t tile0, int64_t row0) {
  const int64_t num_blocks = p.k / kBlockSize;
  const int64_t tile_stride = num_blocks * tile_block_bytes<F>();
  V acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = zero();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* blocks[T];
    for (int t = 0; t < T; ++t) blocks[t] = p.packed + (tile0 + t) * tile_stride + b * tile_block_bytes<F>();
    // Integer sums are exact, so splitting one into kChains independent chains (to hide the
    // dot instruction's latency when few rows share the weights) cannot change a bit.
    constexpr int kChains = R <= 2 ? 2 : 1;
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
        for (int t = 0; t < T; ++t) w[t] = load_bytes(blocks[t] + scale_bytes<F>() + 64 * g);
        for (int r = 0; r < R; ++r) {
          const QI x = splat(load_lane(xb + r * p.xq_row_stride + 4 * g));
          for (int t = 0; t < T; ++t) dots[g % kChains][r][t] = dot_signed(dots[g % kChains][r][t], w[t], x);
        }
      }
    } else {
      for (int g = 0; g < 4; ++g) {
        QI lo[T], hi[T];
        for (int t = 0; t < T; ++t) {
          const QI q = load_bytes(blocks[t] + scale_bytes<F>() + 64 * g);
          lo[t] = low_nibbles(q);
          hi[t] = high_nibbles(q);
        }
        for (int r = 0; r < R; ++r) {
          const QI x_lo = splat(load_lane(xb + r * p.xq_row_stride + 8 * g));
          const QI x_hi = splat(load_lane(xb + r * p.xq_row_stride + 8 * g + 4));
          for (int t = 0; t < T; ++t) {
            dots[0][r][t] = dot_unsigned(dots[0][r][t], lo[t], x_lo);
            dots[kChains - 1][r][t] = dot_unsigned(dots[kChains - 1][r][t], hi[t], x_hi);
          }
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      const V d_w = halves(blocks[t]);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (row0 + r) * p.blocks_row_stride + b;
        QI dot = dots[0][r][t];
        if constexpr (kChains == 2) dot = add(dot, dots[1][r][t]);
        acc[r][t] = fmadd(to_float(dot), mul(d_w, broadcast(p.x_scales[at])), acc[r][t]);
        if constexpr (F == Format::kQ4_1) acc[r][t] = fmadd(halves(blocks[t] + 32), broadcast(p.x_scaled_sums[at]), acc[r][t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const int64_t col0 = (tile0 + t) * kTileColumns;
    for (int r = 0; r < R; ++r) store_columns(p.y + (row0 + r) * p.y_row_stride + col0, acc[r][t], p.n - col0);
  }
}

using TileFn = void(const Int8Problem&, int64_t, int64_t);

// Tiles are walked in groups of kGroupTiles (their weights stay in L1 while every row block
// reads them); within a group each row block takes tiles_for(rows) tiles per call.
constexpr int kGroupTiles = 4;

template <Format F, int R>
void row_block(const Int8Problem& p, int64_t tile0, int64_t tiles, int64_t row0) {
  constexpr int T = tiles_for(R);
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
    for (int64_t row0 = 0; row0 < p.m; row0 += kRows) kBlocks[std::min<int64_t>(kRows, p.m - row0) - 1](p, tile0, tiles, row0);
  }
}

}  // namespace

void quantize_rows_int8(const float* x, int64_t x_row_stride, int64_t k, int64_t row_begin, int64_t row_end,
                        const Int8Activations& out) {
  const int64_t num_blocks = k / kBlockSize;
  for (int64_t row = row_begin; row < row_end; ++row) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const float* xb = x + row * x_row_stride + b * kBlockSize;
      float amax = 0.0f;
      for (int i = 0; i < kBlockSize; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f;
      const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = out.xq + row * out.xq_row_stride + b * kBlockSize;
      int32_t sum = 0;
      for (int i = 0; i < kBlockSize; ++i) {
        // nearbyint under the default rounding mode: round half to even, as torch.round.
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inverse));
        q[i] = static_cast<int8_t>(v);
        sum += v;
      }
      const int64_t at = row * out.blocks_row_stride + b;
      out.x_scales[at] = d;
      out.x_sums[at] = sum;
      out.x_scaled_sums[at] = d * static_cast<float>(sum);
    }
  }
}

void run_tiles_int8(const Int8Problem& problem, int64_t tile_begin, int64_t tile_end) {
  switch (problem.format) {
    case Format::kQ4_0:
      run_format<Format::kQ4_0>(problem, tile_begin, tile_end);
      break;
    case Format::kQ4_1:
      run_format<Format::kQ4_1>(problem, tile_begin, tile_end);
      break;
    case Format::kQ8_0:
      run_format<Format::kQ8_0>(problem, tile_begin, tile_end);
      break;
  }
}

const char* int8_dot_path() { return kDotPath; }

}  // namespace ifb_quant
