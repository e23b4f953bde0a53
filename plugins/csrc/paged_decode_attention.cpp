// Paged decode attention: one query token per request over its own K/V blocks, read in place.
//
// The compiled torch version gathers and reduces through generic loops and reached a quarter of
// the read bandwidth (SmolLM2, 32 rows at 256 tokens of context: 29 of a 55 ms int8 step). Here
// each (request, KV head) item reads its keys once through the block table, for all the query
// heads that share them:
//   pass 1: s_l = (q . k_l) * scale      16-lane FMAs over head_dim, one horizontal sum per key
//                                        (AVX-512: 16 keys' sums as one transposed tree)
//   pass 2: p_l = exp(s_l - max_l s_l)   vectorized exp, their sum in lane order
//   pass 3: out = sum_l p_l v_l / sum    16 lanes of head_dim at a time, keys in order
// Every item is computed alone, in one fixed order, so a request's output is bitwise the same
// whatever else is in the step and however the threads split the items (threads take whole items).
// Pools may hold fp32, fp16 or bf16 (`--kv-dtype`); each element is widened to fp32 on load. A q8_0
// pool (plugins/kv_format.py) holds each head's row as head_dim int8 then one fp16 scale per 32
// (per 16 at head_dim 16): a 16-lane chunk is its int8 widened and times its block's scale, which
// is exact in fp32, so the kernel reads the same values as the torch paths' dequantized blocks.
// With a sliding window (Mistral, Phi-3) an item reads only its row's last `window` keys, in the
// same order, so a row's result still depends on nothing but its own keys. With Gemma 2's
// soft-capping each score passes through cap * tanh(s / cap) before the softmax (scalar tanh, in
// key order: the cost is one tanh per key and head, and the result stays a function of the row).
// With gpt-oss's attention sinks a head's learned sink logit joins the max and, after the keys'
// sum, the denominator, and weights no value: one scalar per head and row, still the row's own.
// These are the fields of one attention contract (the binding's `variant` + `sinks`): a new
// variant is a field here and a branch in attend_heads, not another op.
#include <algorithm>
#include <array>
#include <utility>
#include <cmath>
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

// Heads [head0, head0 + S) of one KV head of one request, head_dim = 16 * CH. The S heads share
// every K/V load, and their S x CH accumulators are independent FMA chains (S * CH <= 16).
template <typename T, int CH, int S>
void attend_heads(const DecodeAttentionProblem& p, int64_t row, int64_t head0, std::vector<float>& scores) {
  const int64_t kv_head = head0 / (p.num_heads / p.num_kv_heads);
  // keys [first, first + length): the row's last `window` keys, or all of them
  const int64_t seq_len = p.seq_lens[row];
  const int64_t first = p.window > 0 && seq_len > p.window ? seq_len - p.window : 0;
  const int64_t length = seq_len - first;
  const int64_t padded = (length + kLanes - 1) / kLanes * kLanes;
  const int64_t* table = p.block_tables + row * p.table_stride;
  using R = Rows<T, CH>;
  using E = typename R::Elem;
  const int64_t slot_stride = p.num_kv_heads * R::kWidth;
  const E* k_base = static_cast<const E*>(p.k_pool) + kv_head * R::kWidth;
  const E* v_base = static_cast<const E*>(p.v_pool) + kv_head * R::kWidth;
  const SlotCursor keys_from_first{table, p.block_size, first};
  float* outs[S];
  for (int g = 0; g < S; ++g) outs[g] = p.out + (row * p.num_heads + head0 + g) * p.head_dim;
  if (length <= 0) {
    for (int g = 0; g < S; ++g) std::fill(outs[g], outs[g] + p.head_dim, 0.0f);
    return;
  }
  scores.assign(static_cast<size_t>(S * padded), 0.0f);
  float* score[S];
  for (int g = 0; g < S; ++g) score[g] = scores.data() + g * padded;

  V q[S][CH];
  for (int g = 0; g < S; ++g)
    for (int c = 0; c < CH; ++c) q[g][c] = load(p.q + (row * p.num_heads + head0 + g) * p.head_dim + c * kLanes);
  int64_t l = 0;
  SlotCursor key_slot = keys_from_first;
#if defined(IFB_SIMD16_AVX512)
  for (; l + kLanes <= length; l += kLanes) {  // 16 keys' scores at once, each summed as sum_lanes sums
    const E* keys[kLanes];
    for (int j = 0; j < kLanes; ++j) keys[j] = k_base + key_slot.take() * slot_stride;
    for (int g = 0; g < S; ++g) {
      V dots[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        const E* k = keys[j];
        V dot = zero();
        for (int c = 0; c < CH; ++c) dot = fmadd(q[g][c], R::chunk(k, c, p.kv_type), dot);
        dots[j] = dot;
      }
      store(score[g] + l, mul(sum_lanes_each(dots), broadcast(p.scale)));
    }
  }
#endif
  for (; l < length; ++l) {
    const E* k = k_base + key_slot.take() * slot_stride;
    V kc[CH];
    for (int c = 0; c < CH; ++c) kc[c] = R::chunk(k, c, p.kv_type);
    for (int g = 0; g < S; ++g) {
      V dot = zero();
      for (int c = 0; c < CH; ++c) dot = fmadd(q[g][c], kc[c], dot);
      score[g][l] = sum_lanes(dot) * p.scale;
    }
  }
  if (p.softcap > 0.0f) {
    for (int g = 0; g < S; ++g)
      for (int64_t l = 0; l < length; ++l) score[g][l] = p.softcap * std::tanh(score[g][l] / p.softcap);
  }

  float inverse[S];
  for (int g = 0; g < S; ++g) {
    for (int64_t l = length; l < padded; ++l) score[g][l] = -INFINITY;
    V peak = broadcast(-INFINITY);
    for (int64_t l = 0; l < padded; l += kLanes) peak = max(peak, load(score[g] + l));
    float top_score = max_lanes(peak);
    if (p.sinks != nullptr) top_score = std::max(top_score, p.sinks[head0 + g]);
    const V top = broadcast(top_score);
    for (int64_t l = 0; l < padded; l += kLanes) store(score[g] + l, exp_nonpositive(sub(load(score[g] + l), top)));
    std::fill(score[g] + length, score[g] + padded, 0.0f);  // the padding's exp(-87), not 0
    V total = zero();
    for (int64_t l = 0; l < padded; l += kLanes) total = add(total, load(score[g] + l));
    float denominator = sum_lanes(total);
    if (p.sinks != nullptr) denominator += exp_of_nonpositive(p.sinks[head0 + g] - top_score);
    inverse[g] = 1.0f / denominator;
  }

  V acc[S][CH];
  for (int g = 0; g < S; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = zero();
  SlotCursor value_slot = keys_from_first;
  for (int64_t l = 0; l < length; ++l) {
    const E* v = v_base + value_slot.take() * slot_stride;
    V vc[CH];
    for (int c = 0; c < CH; ++c) vc[c] = R::chunk(v, c, p.kv_type);
    for (int g = 0; g < S; ++g) {
      const V weight = broadcast(score[g][l]);
      for (int c = 0; c < CH; ++c) acc[g][c] = fmadd(weight, vc[c], acc[g][c]);
    }
  }
  for (int g = 0; g < S; ++g)
    for (int c = 0; c < CH; ++c) store(outs[g] + c * kLanes, mul(acc[g][c], broadcast(inverse[g])));
}

using HeadsFn = void(const DecodeAttentionProblem&, int64_t, int64_t, std::vector<float>&);

template <typename T, int CH, int... Ss>
constexpr std::array<HeadsFn*, sizeof...(Ss)> heads_table(std::integer_sequence<int, Ss...>) {
  return {&attend_heads<T, CH, Ss + 1>...};
}

// All heads of one (request, KV head) item, in sub-groups of at most 16 / CH heads.
template <typename T, int CH>
void attend_item(const DecodeAttentionProblem& p, int64_t item, std::vector<float>& scores) {
  constexpr int kMaxHeads = 16 / CH;
  static constexpr auto kKernels = heads_table<T, CH>(std::make_integer_sequence<int, kMaxHeads>{});
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t row = item / p.num_kv_heads;
  const int64_t first = (item % p.num_kv_heads) * group;
  for (int64_t head = first; head < first + group; head += kMaxHeads)
    kKernels[std::min<int64_t>(kMaxHeads, first + group - head) - 1](p, row, head, scores);
}

template <typename T>
void run_items(const DecodeAttentionProblem& p, int64_t item_begin, int64_t item_end) {
  std::vector<float> scores;
  const int64_t chunks = p.head_dim / kLanes;
  for (int64_t item = item_begin; item < item_end; ++item) {
    switch (chunks) {
      case 1: attend_item<T, 1>(p, item, scores); break;
      case 2: attend_item<T, 2>(p, item, scores); break;
      case 4: attend_item<T, 4>(p, item, scores); break;
      case 8: attend_item<T, 8>(p, item, scores); break;
      default: attend_item<T, 16>(p, item, scores); break;  // head_dim 256 (checked by the binding)
    }
  }
}

}  // namespace

void run_decode_attention(const DecodeAttentionProblem& problem, int64_t item_begin, int64_t item_end) {
  if (problem.kv_type == KvType::kFloat32)
    run_items<float>(problem, item_begin, item_end);
  else if (problem.kv_type == KvType::kQ8_0)
    run_items<Q8Row>(problem, item_begin, item_end);
  else
    run_items<uint16_t>(problem, item_begin, item_end);
}

}  // namespace ifb_quant
