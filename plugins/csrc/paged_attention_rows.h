// Pieces both paged attention kernels read rows and score keys with (decode: one query row per
// item, paged_decode_attention.cpp; prefill tiles: several rows of one request per item,
// paged_prefill_attention.cpp). Sharing them is what keeps a prefill row's bits a decode row's:
// the same row loads, the same dot-product and lane-sum order, the same softmax.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant_kernels.h"
#include "simd16.h"

namespace ifb_quant {
namespace {

// A pool row of fp16 or bf16, widened to fp32 (exact).
inline V load(const uint16_t* p, KvType type) { return type == KvType::kFloat16 ? halves(p) : bfloats(p); }

// exp(x) for x <= 0 (softmax arguments): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6
// polynomial (relative error < 2e-7, a few ulp), times 2^n. Below -87 the result is 0, as
// expf underflows there anyway.
inline V exp_nonpositive(V x) {
  const V clamped = max(x, broadcast(-87.0f));
  const V n = round_nearest(mul(clamped, broadcast(1.44269504088896341f)));
  V r = fmadd(n, broadcast(-0.693145751953125f), clamped);  // ln2 split in two for an exact product
  r = fmadd(n, broadcast(-1.428606765330187e-06f), r);
  V p = broadcast(1.0f / 720);
  p = fmadd(p, r, broadcast(1.0f / 120));
  p = fmadd(p, r, broadcast(1.0f / 24));
  p = fmadd(p, r, broadcast(1.0f / 6));
  p = fmadd(p, r, broadcast(0.5f));
  p = fmadd(p, r, broadcast(1.0f));
  p = fmadd(p, r, broadcast(1.0f));
  return mul(p, pow2(n));
}

// exp(x) for one x <= 0, by the same polynomial as the scores' (a sink's weight).
inline float exp_of_nonpositive(float x) {
  float lanes[kLanes];
  store(lanes, exp_nonpositive(broadcast(x)));
  return lanes[0];
}

// The pool slots of a row's consecutive key positions: one table read and division per block, not
// per key and pass (a 300-token causal prefill, 9 heads of 64 over 3 KV heads, one thread:
// 1.36 -> 1.17 ms of attention).
struct SlotCursor {
  const int64_t* table;
  int64_t block_size;
  int64_t position;      // of the next key
  int64_t slot = 0;      // its pool slot, once `left` > 0
  int64_t left = 0;      // keys left in the block `slot` is in

  // The next key's slot (the table is read only for blocks a key is taken from).
  int64_t take() {
    if (left == 0) {
      const int64_t offset = position % block_size;
      slot = table[position / block_size] * block_size + offset;
      left = block_size - offset;
    }
    --left;
    ++position;
    return slot++;
  }
};

#if defined(IFB_SIMD16_AVX512)
// The lane sums of 16 vectors (one per key) as one vector, in key order, each added in sum_lanes'
// order (i + i+8, i + i+4, i + i+2, i + i+1) so the scores keep their bits: a transposed tree of
// 15 adds instead of 16 separate horizontal sums (each ~6 dependent shuffles and adds), which
// were half of a key's work in pass 1 at head_dim 64 (with the slot cursor: 1.60 -> 1.17 ms for
// that prefill's attention, the same bits).
inline V sum_lanes_each(const V (&d)[kLanes]) {
  __m512 eighths[8], quarters[4], halves_[2];
  for (int j = 0; j < 8; ++j) {  // keys 2j, 2j+1: lanes i + i+8
    const __m512 a = d[2 * j].a, b = d[2 * j + 1].a;
    eighths[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int j = 0; j < 4; ++j) {  // keys 4j..4j+3, one per 128-bit chunk: i + i+4
    const __m512 a = eighths[2 * j], b = eighths[2 * j + 1];
    quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int j = 0; j < 2; ++j) {  // chunk c: keys 8j+c and 8j+4+c, two values each: i + i+2
    const __m512d a = _mm512_castps_pd(quarters[2 * j]), b = _mm512_castps_pd(quarters[2 * j + 1]);
    halves_[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // i + i+1: lane 4c + t then holds key c + 4t; the permute puts key k at lane k.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(halves_[0], halves_[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(halves_[0], halves_[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i key_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(key_order, sums)};
}
#endif

template <typename T>
inline V load_kv(const T* p, KvType type) {
  if constexpr (std::is_same_v<T, float>) {
    (void)type;
    return load(p);
  } else {
    return load(p, type);
  }
}

struct Q8Row {};  // the tag of q8_0 pools' rows

// One head's row of a pool of T (head_dim = 16 * CH): its elements, its width in them, and its
// 16-lane chunk c as fp32.
template <typename T, int CH>
struct Rows {
  using Elem = T;
  static constexpr int64_t kWidth = CH * kLanes;
  static V chunk(const Elem* row, int c, KvType type) { return load_kv(row + c * kLanes, type); }
};

template <int CH>
struct Rows<Q8Row, CH> {
  using Elem = uint8_t;
  static constexpr int kHeadDim = CH * kLanes;
  static constexpr int kBlock = kHeadDim < 32 ? kHeadDim : 32;
  static constexpr int64_t kWidth = kHeadDim + 2 * (kHeadDim / kBlock);  // int8 values, fp16 scales
  static V chunk(const Elem* row, int c, KvType) {
    uint16_t scale_bits;
    std::memcpy(&scale_bits, row + kHeadDim + 2 * (c * kLanes / kBlock), sizeof(scale_bits));
    return mul(to_float(bytes_signed(row + c * kLanes)), broadcast(_cvtsh_ss(scale_bits)));
  }
};

// A row's softmax over its scores [0, length) in place, for one head: `score` has room for
// `padded` (length rounded up to 16) floats; [length, padded) is overwritten. Returns
// 1 / denominator; the weights are left in score[0, length). The max and the sum go over whole
// 16-lane chunks from score[0], so the sum's order depends only on the row's own length.
inline float softmax_in_place(float* score, int64_t length, int64_t padded, const float* sink) {
  for (int64_t l = length; l < padded; ++l) score[l] = -INFINITY;
  V peak = broadcast(-INFINITY);
  for (int64_t l = 0; l < padded; l += kLanes) peak = max(peak, load(score + l));
  float top_score = max_lanes(peak);
  if (sink != nullptr) top_score = std::max(top_score, *sink);
  const V top = broadcast(top_score);
  for (int64_t l = 0; l < padded; l += kLanes) store(score + l, exp_nonpositive(sub(load(score + l), top)));
  std::fill(score + length, score + padded, 0.0f);  // the padding's exp(-87), not 0
  V total = zero();
  for (int64_t l = 0; l < padded; l += kLanes) total = add(total, load(score + l));
  float denominator = sum_lanes(total);
  if (sink != nullptr) denominator += exp_of_nonpositive(*sink - top_score);
  return 1.0f / denominator;
}

// Gemma 2's soft-cap of a row's scores [0, length), scalar tanh in key order.
inline void cap_scores(float* score, int64_t length, float softcap) {
  for (int64_t l = 0; l < length; ++l) score[l] = softcap * std::tanh(score[l] / softcap);
}

}  // namespace

// The rows [row_begin, row_end) of one tile (rows sharing a block table) for one KV head
// (paged_prefill_attention.cpp); `scratch` is the calling thread's, reused across items.
void attend_prefill_tile(const DecodeAttentionProblem& p, int64_t row_begin, int64_t row_end, int64_t kv_head,
                         std::vector<float>& scratch);

}  // namespace ifb_quant
