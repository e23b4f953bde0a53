// 16-lane vector wrappers shared by every kernel TU: one AVX-512 register or two AVX2 registers.
//
// The kernels are written once against V (16 fp32 lanes) and QI (16 int32 lanes, or 64 bytes
// seen byte-wise); each wrapper is one intrinsic per register, so the AVX2 build performs the
// same IEEE operations lane for lane and gives the AVX-512 build's exact bits. Everything has
// internal linkage: each TU gets its own copy compiled with its own ISA flags.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace ifb_quant {
namespace {

constexpr int kLanes = 16;

// The one order both builds sum lanes in: of 8, lanes i + i+4, then i + i+2, then i + i+1.
// (The AVX2 build used to add its 16 lanes serially and AVX-512 used _mm512_reduce_add_ps's
// tree: decode attention's scores then differed between the builds in the last bit.)
inline float sum_eight(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define IFB_SIMD16_AVX512 1
struct V {  // 16 fp32 lanes: one per output column of a tile
  __m512 a;
};
struct QI {  // 16 int32 lanes, or 64 bytes
  __m512i a;
};
inline V zero() { return {_mm512_setzero_ps()}; }
inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v.a); }
inline V broadcast(float x) { return {_mm512_set1_ps(x)}; }
inline V fmadd(V a, V b, V c) { return {_mm512_fmadd_ps(a.a, b.a, c.a)}; }
inline V fmsub(V a, V b, V c) { return {_mm512_fmsub_ps(a.a, b.a, c.a)}; }    // a * b - c, one rounding
inline V fnmadd(V a, V b, V c) { return {_mm512_fnmadd_ps(a.a, b.a, c.a)}; }  // c - a * b, one rounding
inline V mul(V a, V b) { return {_mm512_mul_ps(a.a, b.a)}; }
inline V add(V a, V b) { return {_mm512_add_ps(a.a, b.a)}; }
inline V sub(V a, V b) { return {_mm512_sub_ps(a.a, b.a)}; }
inline V max(V a, V b) { return {_mm512_max_ps(a.a, b.a)}; }
inline float sum_lanes(V v) {  // lanes i + i+8 first, then sum_eight's tree, as the AVX2 build
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.a), 1));
  return sum_eight(_mm256_add_ps(_mm512_castps512_ps256(v.a), high));
}
inline float max_lanes(V v) { return _mm512_reduce_max_ps(v.a); }
inline V round_nearest(V v) { return {_mm512_roundscale_ps(v.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V abs_(V v) { return {_mm512_abs_ps(v.a)}; }
// Rounded to int32 in the current rounding mode (half to even by default), as std::nearbyint.
inline QI to_int(V v) { return {_mm512_cvtps_epi32(v.a)}; }
// 2^n for integral n in [-126, 127], exactly, through the exponent field.
inline V pow2(V n) {
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.a), _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(bits)};
}
// 16 fp16 / bf16 values widened to fp32 (both exact).
inline V halves(const void* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)))}; }
inline V bfloats(const void* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
// 16 bytes widened to 16 int32 lanes.
inline QI bytes_unsigned(const uint8_t* p) {
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline QI bytes_signed(const uint8_t* p) {
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline QI load_bytes(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }  // 64 bytes as they lie
inline QI splat(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline V to_float(QI q) { return {_mm512_cvtepi32_ps(q.a)}; }
inline int32_t sum_int_lanes(QI q) { return _mm512_reduce_add_epi32(q.a); }
// The 16 int32 lanes (each within int8's range) stored as 16 bytes.
inline void store_int8(int8_t* p, QI q) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(q.a)); }
// int32-lane arithmetic.
inline QI add(QI a, QI b) { return {_mm512_add_epi32(a.a, b.a)}; }
inline QI sub(QI a, QI b) { return {_mm512_sub_epi32(a.a, b.a)}; }
inline QI mullo(QI a, QI b) { return {_mm512_mullo_epi32(a.a, b.a)}; }
inline QI srli(QI q, unsigned n) { return {_mm512_srli_epi32(q.a, n)}; }
inline QI slli(QI q, unsigned n) { return {_mm512_slli_epi32(q.a, n)}; }
inline QI srai(QI q, unsigned n) { return {_mm512_srai_epi32(q.a, n)}; }
// Bitwise.
inline QI and_(QI a, QI b) { return {_mm512_and_si512(a.a, b.a)}; }
inline QI or_(QI a, QI b) { return {_mm512_or_si512(a.a, b.a)}; }
// a | (b & keep) in one instruction (vpternlogd truth table 0xF8).
inline QI merge_bits(QI a, QI b, QI keep) { return {_mm512_ternarylogic_epi32(a.a, b.a, keep.a, 0xF8)}; }
// Byte-wise: shifts are per 16-bit lane, so callers mask the bits that cross a byte.
inline QI splat8(int8_t x) { return {_mm512_set1_epi8(x)}; }
inline QI srli16(QI q, unsigned n) { return {_mm512_srli_epi16(q.a, n)}; }
inline QI slli16(QI q, unsigned n) { return {_mm512_slli_epi16(q.a, n)}; }
// Byte-wise table lookup: byte j of the result is byte (idx[j] & 15) of the 16-byte lane of
// `table` that holds j (0 where idx[j] has bit 7 set); tables repeat their 16 bytes in every lane.
inline QI lookup16(QI table, QI idx) { return {_mm512_shuffle_epi8(table.a, idx.a)}; }

#if defined(__AVX512VNNI__)
constexpr const char* kDotPath = "vnni";
// Signed weights go in as w + 128 (vpdpbusd's first operand is unsigned); the accumulator starts
// at -128 * sum_x, which is exact.
constexpr int32_t kSignedOffset = 128;
// acc + sum of the 4 u8 x s8 products in each int32 lane.
inline QI dot_unsigned(QI acc, QI w, QI x) { return {_mm512_dpbusd_epi32(acc.a, w.a, x.a)}; }
inline QI dot_signed(QI acc, QI w, QI x) {
  return {_mm512_dpbusd_epi32(acc.a, _mm512_xor_si512(w.a, _mm512_set1_epi8(-128)), x.a)};
}
// Two dots into one accumulator (see the maddubs paths'); here simply two vpdpbusd.
constexpr bool kPairedDots = false;
inline QI dot_unsigned2(QI acc, QI w0, QI x0, QI w1, QI x1) { return dot_unsigned(dot_unsigned(acc, w0, x0), w1, x1); }
#else
constexpr const char* kDotPath = "maddubs";
constexpr int32_t kSignedOffset = 0;
// Pairs of u8 x s8 products sum to at most 2 * 63 * 127 (Q6_K's 6-bit values) or 2 * 128 * 127
// (the sign trick below): maddubs never saturates, so the int32 total is exact.
inline QI dot_unsigned(QI acc, QI w, QI x) {
  const __m512i pairs = _mm512_maddubs_epi16(w.a, x.a);
  return {_mm512_add_epi32(acc.a, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
inline QI dot_signed(QI acc, QI w, QI x) {
  const __m512i x_signed = _mm512_mask_sub_epi8(x.a, _mm512_movepi8_mask(w.a), _mm512_setzero_si512(), x.a);
  return dot_unsigned(acc, {_mm512_abs_epi8(w.a)}, {x_signed});
}
// acc + w0 . x0 + w1 . x1 for u8 weights of at most 63 (every unsigned format): each maddubs pair
// sum is at most 2 * 63 * 128 = 16128 in magnitude, two of them add in int16 without overflow,
// and one madd widens both: 5 instructions for two dots instead of 6, the same exact integer.
constexpr bool kPairedDots = true;
inline QI dot_unsigned2(QI acc, QI w0, QI x0, QI w1, QI x1) {
  const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(w0.a, x0.a), _mm512_maddubs_epi16(w1.a, x1.a));
  return {_mm512_add_epi32(acc.a, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))};
}
#endif

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define IFB_SIMD16_AVX2 1
struct V {
  __m256 lo, hi;
};
struct QI {
  __m256i lo, hi;
};
inline V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline V broadcast(float x) {
  const __m256 b = _mm256_set1_ps(x);
  return {b, b};
}
inline V fmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V fmsub(V a, V b, V c) { return {_mm256_fmsub_ps(a.lo, b.lo, c.lo), _mm256_fmsub_ps(a.hi, b.hi, c.hi)}; }
inline V fnmadd(V a, V b, V c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V max(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float sum_lanes(V v) { return sum_eight(_mm256_add_ps(v.lo, v.hi)); }  // lanes i + i+8 first
inline float max_lanes(V v) {
  alignas(32) float lanes[16];
  store(lanes, v);
  return *std::max_element(lanes, lanes + 16);
}
inline V round_nearest(V v) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(v.lo, kMode), _mm256_round_ps(v.hi, kMode)};
}
inline V abs_(V v) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(v.lo, magnitude), _mm256_and_ps(v.hi, magnitude)};
}
inline QI to_int(V v) { return {_mm256_cvtps_epi32(v.lo), _mm256_cvtps_epi32(v.hi)}; }
inline __m256 pow2_half(__m256 n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(bits);
}
inline V pow2(V n) { return {pow2_half(n.lo), pow2_half(n.hi)}; }
inline V halves(const void* p) {
  const auto* q = static_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline __m256 bfloat8(const __m128i* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
}
inline V bfloats(const void* p) {
  const auto* q = static_cast<const __m128i*>(p);
  return {bfloat8(q), bfloat8(q + 1)};
}
inline QI bytes_unsigned(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline QI bytes_signed(const uint8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline QI load_bytes(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline QI splat(int32_t x) {
  const __m256i b = _mm256_set1_epi32(x);
  return {b, b};
}
inline V to_float(QI q) { return {_mm256_cvtepi32_ps(q.lo), _mm256_cvtepi32_ps(q.hi)}; }
inline int32_t sum_int_lanes(QI q) {
  const __m256i eight = _mm256_add_epi32(q.lo, q.hi);
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(eight), _mm256_extracti128_si256(eight, 1));
  const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
}
inline void store_int8(int8_t* p, QI q) {
  // packs works within 128-bit halves: (lo 0-3, hi 0-3 | lo 4-7, hi 4-7); the permute puts lo first.
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q.lo, q.hi), 0xD8);
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
}
inline QI add(QI a, QI b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline QI sub(QI a, QI b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline QI mullo(QI a, QI b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline QI srli(QI q, unsigned n) {
  const __m128i count = _mm_cvtsi32_si128(static_cast<int>(n));
  return {_mm256_srl_epi32(q.lo, count), _mm256_srl_epi32(q.hi, count)};
}
inline QI slli(QI q, unsigned n) {
  const __m128i count = _mm_cvtsi32_si128(static_cast<int>(n));
  return {_mm256_sll_epi32(q.lo, count), _mm256_sll_epi32(q.hi, count)};
}
inline QI srai(QI q, unsigned n) {
  const __m128i count = _mm_cvtsi32_si128(static_cast<int>(n));
  return {_mm256_sra_epi32(q.lo, count), _mm256_sra_epi32(q.hi, count)};
}
inline QI and_(QI a, QI b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline QI or_(QI a, QI b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline QI merge_bits(QI a, QI b, QI keep) { return or_(a, and_(b, keep)); }
inline QI splat8(int8_t x) {
  const __m256i b = _mm256_set1_epi8(x);
  return {b, b};
}
inline QI srli16(QI q, unsigned n) {
  const __m128i count = _mm_cvtsi32_si128(static_cast<int>(n));
  return {_mm256_srl_epi16(q.lo, count), _mm256_srl_epi16(q.hi, count)};
}
inline QI slli16(QI q, unsigned n) {
  const __m128i count = _mm_cvtsi32_si128(static_cast<int>(n));
  return {_mm256_sll_epi16(q.lo, count), _mm256_sll_epi16(q.hi, count)};
}
inline QI lookup16(QI table, QI idx) {
  return {_mm256_shuffle_epi8(table.lo, idx.lo), _mm256_shuffle_epi8(table.hi, idx.hi)};
}

constexpr const char* kDotPath = "maddubs";
constexpr int32_t kSignedOffset = 0;
inline __m256i dot8(__m256i acc, __m256i w, __m256i x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
inline QI dot_unsigned(QI acc, QI w, QI x) { return {dot8(acc.lo, w.lo, x.lo), dot8(acc.hi, w.hi, x.hi)}; }
// As the AVX-512 maddubs path's dot_unsigned2: two dots of u8 weights <= 63, one madd (exact).
constexpr bool kPairedDots = true;
inline __m256i dot8x2(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline QI dot_unsigned2(QI acc, QI w0, QI x0, QI w1, QI x1) {
  return {dot8x2(acc.lo, w0.lo, x0.lo, w1.lo, x1.lo), dot8x2(acc.hi, w0.hi, x0.hi, w1.hi, x1.hi)};
}
inline QI dot_signed(QI acc, QI w, QI x) {
  return {dot8(acc.lo, _mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(x.lo, w.lo)),
          dot8(acc.hi, _mm256_sign_epi8(w.hi, w.hi), _mm256_sign_epi8(x.hi, w.hi))};
}

#else
#error "ifb_quant kernels need -mavx512f -mavx512bw -mavx512vl or -mavx2 -mfma -mf16c"
#endif

// Lane-wise helpers built on the wrappers (so both ISAs share them).
inline QI mask(QI q, int32_t bits) { return and_(q, splat(bits)); }
inline QI low_nibble(QI q) { return mask(q, 15); }  // of zero-extended bytes
inline QI high_nibble(QI q) { return srli(q, 4); }
// Moves bit `from` of each int32 lane to bit `to` (other bits of the result are garbage).
inline QI shift_bit(QI q, int from, int to) {
  return from >= to ? srli(q, static_cast<unsigned>(from - to)) : slli(q, static_cast<unsigned>(to - from));
}
// Byte-wise nibbles of 64 bytes.
inline QI low_nibbles(QI q) { return and_(q, splat8(15)); }
inline QI high_nibbles(QI q) { return and_(srli16(q, 4), splat8(15)); }
// Byte-wise: moves bit `from` (0..7) of every byte to bit `to`. A 16-bit shift by s also brings
// s bits of the neighbouring byte in, at positions the caller's mask must exclude.
inline QI move_bits8(QI q, int from, int to) {
  if (from == to) return q;
  return from > to ? srli16(q, static_cast<unsigned>(from - to)) : slli16(q, static_cast<unsigned>(to - from));
}

}  // namespace
}  // namespace ifb_quant
