// Paged attention for a tile of query rows that share one block table (a request's rows in a
// prefill chunk), each row's bits exactly the decode kernel's.
//
// Run one at a time through the decode kernel, a 448-token chunk over 1,536 cached tokens reads
// ~2,000 keys for every row: K/V are loaded and widened once per row and head group, from L2 or
// memory. Here the tile's rows [row_begin, row_end) go through the keys together, a block of
// keys at a time (kKeyBlockFloats of widened K or V, which stays in L1):
//   pass 1: widen a block of keys once; each row's scores for its keys in the block, each key's
//           dot product summed as decode sums it (16-lane FMAs over head_dim in chunk order, then
//           sum_lanes' tree, or its 16-key transpose on AVX-512, which gives the same bits)
//   softmax: per row and head, paged_attention_rows.h's softmax_in_place, decode's own code
//   pass 3: widen a block of values once; each row's accumulators take its keys in key order
//           (one FMA chain per lane, parked in memory between blocks: fp32 stores are exact)
// A row's result is a function of its own query and keys only: which keys a block holds and
// how many rows share the tile change where a value is loaded from, never an operation on it.
// Rows past their own length in the tile (causal rows, a sliding window) skip those keys.
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "paged_attention_rows.h"

namespace ifb_quant {
namespace {

// Widened keys (or values) held per block: 16 KB, a third of a 48 KB L1, so the block, a row's
// query and its accumulators stay there while every row of the tile reads them.
constexpr int64_t kKeyBlockFloats = 4096;

struct TileRow {
  int64_t first;   // the row's keys are [first, first + length)
  int64_t length;
  int64_t padded;  // length rounded up to 16: its softmax's room
};

// Widens keys [begin, end) of one KV head into `out` (key-major, head_dim floats each).
template <typename R>
void widen_keys(const DecodeAttentionProblem& p, const typename R::Elem* base, const int64_t* table, int64_t begin,
                int64_t end, float* out) {
  SlotCursor slot{table, p.block_size, begin};
  const int64_t slot_stride = p.num_kv_heads * R::kWidth;
  const int chunks = static_cast<int>(p.head_dim / kLanes);
  for (int64_t key = begin; key < end; ++key, out += p.head_dim) {
    const typename R::Elem* row = base + slot.take() * slot_stride;
    for (int c = 0; c < chunks; ++c) store(out + c * kLanes, R::chunk(row, c, p.kv_type));
  }
}

// Scores of one row and head for keys [begin, end) of a widened block starting at key
// `block_first`: decode's dot products and lane sums, times the scale.
template <int CH>
void score_keys(const V (&q)[CH], const float* keys, int64_t block_first, int64_t begin, int64_t end, float scale,
                float* score) {
  int64_t l = begin;
#if defined(IFB_SIMD16_AVX512)
  for (; l + kLanes <= end; l += kLanes) {
    V dots[kLanes];
    // Unrolled, the 16 keys' FMA chains are independent registers; rolled, gcc parked each dot
    // on the stack and the tree reloaded them.
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) {
      const float* k = keys + (l + j - block_first) * CH * kLanes;
      V dot = zero();
      for (int c = 0; c < CH; ++c) dot = fmadd(q[c], load(k + c * kLanes), dot);
      dots[j] = dot;
    }
    store(score + l, mul(sum_lanes_each(dots), broadcast(scale)));
  }
#endif
  for (; l < end; ++l) {
    const float* k = keys + (l - block_first) * CH * kLanes;
    V dot = zero();
    for (int c = 0; c < CH; ++c) dot = fmadd(q[c], load(k + c * kLanes), dot);
    score[l] = sum_lanes(dot) * scale;
  }
}

// For S heads at once: acc_g[c] += weight_g[l] * value[l] for keys [begin, end), in key order
// (decode's FMA chains); each value chunk is loaded once for the S heads (S * CH <= 16).
template <int CH, int S>
void accumulate_values(float* const* weights, const float* values, int64_t block_first, int64_t begin, int64_t end,
                       float* const* acc_memory) {
  V acc[S][CH];
  for (int g = 0; g < S; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = load(acc_memory[g] + c * kLanes);
  for (int64_t l = begin; l < end; ++l) {
    const float* v = values + (l - block_first) * CH * kLanes;
    V vc[CH];
    for (int c = 0; c < CH; ++c) vc[c] = load(v + c * kLanes);
    for (int g = 0; g < S; ++g) {
      const V weight = broadcast(weights[g][l]);
      for (int c = 0; c < CH; ++c) acc[g][c] = fmadd(weight, vc[c], acc[g][c]);
    }
  }
  for (int g = 0; g < S; ++g)
    for (int c = 0; c < CH; ++c) store(acc_memory[g] + c * kLanes, acc[g][c]);
}

using AccumulateFn = void(float* const*, const float*, int64_t, int64_t, int64_t, float* const*);

template <int CH, int... Ss>
constexpr std::array<AccumulateFn*, sizeof...(Ss)> accumulate_table(std::integer_sequence<int, Ss...>) {
  return {&accumulate_values<CH, Ss + 1>...};
}

template <typename T, int CH>
void attend_tile_typed(const DecodeAttentionProblem& p, int64_t row_begin, int64_t row_end, int64_t kv_head,
                       std::vector<float>& scratch) {
  using R = Rows<T, CH>;
  constexpr int64_t kHeadDim = CH * kLanes;
  constexpr int kMaxHeads = 16 / CH;
  static constexpr auto kAccumulate = accumulate_table<CH>(std::make_integer_sequence<int, kMaxHeads>{});
  const int64_t rows = row_end - row_begin;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t head0 = kv_head * group;
  std::vector<TileRow> spans(static_cast<size_t>(rows));
  int64_t base = INT64_MAX, end = 0;  // the tile's keys: the union of its rows'
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t seq_len = p.seq_lens[row_begin + r];
    const int64_t first = p.window > 0 && seq_len > p.window ? seq_len - p.window : 0;
    const int64_t length = seq_len - first;
    spans[r] = {first, length, (length + kLanes - 1) / kLanes * kLanes};
    if (length > 0) base = std::min(base, first), end = std::max(end, seq_len);
  }
  // scores [rows][group][stride], indexed by key - base; stride leaves room for any row's padding
  const int64_t stride = end > base ? (end - base + kLanes) / kLanes * kLanes + kLanes : 0;
  const int64_t block_keys = kKeyBlockFloats / kHeadDim;
  const size_t score_floats = static_cast<size_t>(rows * group * stride);
  const size_t acc_floats = static_cast<size_t>(rows * group * kHeadDim);
  scratch.resize(score_floats + acc_floats + static_cast<size_t>(kKeyBlockFloats));
  float* scores = scratch.data();
  float* accs = scores + score_floats;
  float* block = accs + acc_floats;
  std::fill(accs, accs + acc_floats, 0.0f);
  const int64_t* table = p.block_tables + row_begin * p.table_stride;
  using E = typename R::Elem;
  const E* k_base = static_cast<const E*>(p.k_pool) + kv_head * R::kWidth;
  const E* v_base = static_cast<const E*>(p.v_pool) + kv_head * R::kWidth;
  auto score_of = [&](int64_t r, int64_t g) { return scores + (r * group + g) * stride - base; };  // by key

  for (int64_t b0 = base; b0 < end; b0 += block_keys) {  // pass 1
    const int64_t b1 = std::min(end, b0 + block_keys);
    widen_keys<R>(p, k_base, table, b0, b1, block);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t begin = std::max(b0, spans[r].first), stop = std::min(b1, spans[r].first + spans[r].length);
      if (begin >= stop) continue;
      const float* q_row = p.q + ((row_begin + r) * p.num_heads + head0) * kHeadDim;
      for (int64_t g = 0; g < group; ++g) {
        V q[CH];
        for (int c = 0; c < CH; ++c) q[c] = load(q_row + g * kHeadDim + c * kLanes);
        score_keys<CH>(q, block, b0, begin, stop, p.scale, score_of(r, g));
      }
    }
  }
  std::vector<float> inverse(static_cast<size_t>(rows * group));
  for (int64_t r = 0; r < rows; ++r) {
    if (spans[r].length <= 0) continue;
    for (int64_t g = 0; g < group; ++g) {
      float* score = score_of(r, g) + spans[r].first;
      if (p.softcap > 0.0f) cap_scores(score, spans[r].length, p.softcap);
      inverse[r * group + g] =
          softmax_in_place(score, spans[r].length, spans[r].padded, p.sinks == nullptr ? nullptr : p.sinks + head0 + g);
    }
  }
  for (int64_t b0 = base; b0 < end; b0 += block_keys) {  // pass 3
    const int64_t b1 = std::min(end, b0 + block_keys);
    widen_keys<R>(p, v_base, table, b0, b1, block);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t begin = std::max(b0, spans[r].first), stop = std::min(b1, spans[r].first + spans[r].length);
      if (begin >= stop) continue;
      for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
        const int heads = static_cast<int>(std::min<int64_t>(kMaxHeads, group - g0));
        float* weights[kMaxHeads];
        float* acc[kMaxHeads];
        for (int g = 0; g < heads; ++g) weights[g] = score_of(r, g0 + g), acc[g] = accs + (r * group + g0 + g) * kHeadDim;
        kAccumulate[heads - 1](weights, block, b0, begin, stop, acc);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      float* out = p.out + ((row_begin + r) * p.num_heads + head0 + g) * kHeadDim;
      const float* acc = accs + (r * group + g) * kHeadDim;
      if (spans[r].length <= 0) {
        std::fill(out, out + kHeadDim, 0.0f);
        continue;
      }
      const V scale = broadcast(inverse[r * group + g]);
      for (int c = 0; c < CH; ++c) store(out + c * kLanes, mul(load(acc + c * kLanes), scale));
    }
  }
}

template <typename T>
void attend_tile_of(const DecodeAttentionProblem& p, int64_t row_begin, int64_t row_end, int64_t kv_head,
                    std::vector<float>& scratch) {
  switch (p.head_dim / kLanes) {
    case 1: attend_tile_typed<T, 1>(p, row_begin, row_end, kv_head, scratch); break;
    case 2: attend_tile_typed<T, 2>(p, row_begin, row_end, kv_head, scratch); break;
    case 4: attend_tile_typed<T, 4>(p, row_begin, row_end, kv_head, scratch); break;
    case 8: attend_tile_typed<T, 8>(p, row_begin, row_end, kv_head, scratch); break;
    default: attend_tile_typed<T, 16>(p, row_begin, row_end, kv_head, scratch); break;  // head_dim 256
  }
}

}  // namespace

void attend_prefill_tile(const DecodeAttentionProblem& p, int64_t row_begin, int64_t row_end, int64_t kv_head,
                         std::vector<float>& scratch) {
  if (p.kv_type == KvType::kFloat32)
    attend_tile_of<float>(p, row_begin, row_end, kv_head, scratch);
  else if (p.kv_type == KvType::kQ8_0)
    attend_tile_of<Q8Row>(p, row_begin, row_end, kv_head, scratch);
  else
    attend_tile_of<uint16_t>(p, row_begin, row_end, kv_head, scratch);
}

}  // namespace ifb_quant
