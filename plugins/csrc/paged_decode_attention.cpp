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
// variant is a field here and a branch in attend_heads and the prefill tile, not another op.
// Rows that share a block table (a request's prompt chunk) are planned into tiles here and run by
// paged_prefill_attention.cpp, which loads their K/V once per tile and gives each row these bits.
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "paged_attention_rows.h"

namespace ifb_quant {
namespace {

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
  if (p.softcap > 0.0f)
    for (int g = 0; g < S; ++g) cap_scores(score[g], length, p.softcap);

  float inverse[S];
  for (int g = 0; g < S; ++g)
    inverse[g] = softmax_in_place(score[g], length, padded, p.sinks == nullptr ? nullptr : p.sinks + head0 + g);

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
void attend_item(const DecodeAttentionProblem& p, int64_t row, int64_t kv_head, std::vector<float>& scores) {
  constexpr int kMaxHeads = 16 / CH;
  static constexpr auto kKernels = heads_table<T, CH>(std::make_integer_sequence<int, kMaxHeads>{});
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t first = kv_head * group;
  for (int64_t head = first; head < first + group; head += kMaxHeads)
    kKernels[std::min<int64_t>(kMaxHeads, first + group - head) - 1](p, row, head, scores);
}

template <typename T>
void attend_row(const DecodeAttentionProblem& p, int64_t row, int64_t kv_head, std::vector<float>& scores) {
  switch (p.head_dim / kLanes) {
    case 1: attend_item<T, 1>(p, row, kv_head, scores); break;
    case 2: attend_item<T, 2>(p, row, kv_head, scores); break;
    case 4: attend_item<T, 4>(p, row, kv_head, scores); break;
    case 8: attend_item<T, 8>(p, row, kv_head, scores); break;
    default: attend_item<T, 16>(p, row, kv_head, scores); break;  // head_dim 256 (checked by the binding)
  }
}

// Two rows may share a tile when they read the same pool slots: the same block table row.
bool same_table(const DecodeAttentionProblem& p, int64_t a, int64_t b) {
  return std::equal(p.block_tables + a * p.table_stride, p.block_tables + (a + 1) * p.table_stride,
                    p.block_tables + b * p.table_stride);
}

}  // namespace

std::vector<AttentionTile> plan_attention_tiles(const DecodeAttentionProblem& problem) {
  // Tiles pay where a KV head's group fills decode's register block (group x head_dim >= 256:
  // 16 accumulators and 16 query vectors, which spill): Llama-3.2-1B's 4 x 64, one layer of 448
  // rows over 1,536 cached tokens, one thread, 171 -> 94 ms. Below it the row-at-a-time kernel
  // is faster than the tile's copies and calls: SmolLM2's 3 x 64, 25 ms a row at a time, 35
  // tiled. Either path gives every row the same bits; this only picks the faster.
  const bool tiles_pay = problem.num_heads / problem.num_kv_heads * problem.head_dim >= 256;
  std::vector<AttentionTile> tiles;
  for (int64_t row = 0; row < problem.num_rows; ++row) {
    if (tiles_pay && !tiles.empty() && tiles.back().row_end - tiles.back().row_begin < kAttentionTileRows &&
        same_table(problem, tiles.back().row_begin, row))
      ++tiles.back().row_end;
    else
      tiles.push_back({row, row + 1});
  }
  return tiles;
}

void run_paged_attention_items(const DecodeAttentionProblem& problem, const std::vector<AttentionTile>& tiles,
                               int64_t item_begin, int64_t item_end) {
  std::vector<float> scratch;
  for (int64_t item = item_begin; item < item_end; ++item) {
    // KV-head-major: a thread's consecutive items are one head's tiles, whose keys (a 1,760-key
    // context of 64-wide fp32 K and V: 900 KB) stay in L2 from one tile to the next.
    const int64_t num_tiles = static_cast<int64_t>(tiles.size());
    const AttentionTile& tile = tiles[item % num_tiles];
    const int64_t kv_head = item / num_tiles;
    if (tile.row_end - tile.row_begin > 1)
      attend_prefill_tile(problem, tile.row_begin, tile.row_end, kv_head, scratch);
    else if (problem.kv_type == KvType::kFloat32)
      attend_row<float>(problem, tile.row_begin, kv_head, scratch);
    else if (problem.kv_type == KvType::kQ8_0)
      attend_row<Q8Row>(problem, tile.row_begin, kv_head, scratch);
    else
      attend_row<uint16_t>(problem, tile.row_begin, kv_head, scratch);
  }
}

}  // namespace ifb_quant
