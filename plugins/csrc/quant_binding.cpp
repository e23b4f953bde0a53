// Torch binding of the engine's own kernels (block-quantized matmuls, paged decode attention):
// CPU kernels for the ifb_quant ops and AOTI C shims.
//
// The op schemas are defined in Python (plugins/quant_ops.py); this file registers their CPU
// kernels, splits the column tiles over at::parallel_for (torch.set_num_threads applies), and
// exports extern "C" shims with the names AOTInductor generates for ops listed in
// config.aot_inductor.custom_ops_to_c_shims, so a compiled graph calls the kernel directly.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "quant_kernels.h"

#define IFB_EXPORT extern "C" __attribute__((visibility("default")))

namespace ifb_quant {
namespace {

// The names are the values of plugins/quant_formats.py's WeightFormat (block_format_table.h, expanded into kFormats).
Format parse_format(c10::string_view name) {
  std::string known;
  for (const FormatInfo& info : kFormats) {
    if (name == info.name) return info.format;
    known += known.empty() ? info.name : std::string(", ") + info.name;
  }
  TORCH_CHECK(false, "ifb_quant: unknown block format '", std::string(name), "' (", known, ")");
}

void check_packed(const at::Tensor& packed, Format format, int64_t n, int64_t k) {
  const int64_t weights = block_weights(format);
  TORCH_CHECK(n > 0 && k > 0 && k % weights == 0, "ifb_quant: k must be a positive multiple of ", weights, " for ",
              format_info(format).name, ", got n=", n, " k=", k);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "ifb_quant: packed weights must be a contiguous CPU uint8 tensor");
  const int64_t expected = num_tiles(n) * (k / weights) * kTileColumns * block_bytes(format);
  TORCH_CHECK(packed.numel() == expected, "ifb_quant: packed weights hold ", packed.numel(), " bytes, expected ",
              expected, " for n=", n, " k=", k);
}

// Grain in tiles: chunks under ~32K multiply-adds are not worth waking a second thread for.
int64_t grain_tiles(int64_t m, int64_t k) { return std::max<int64_t>(1, (int64_t{1} << 15) / (m * k * kTileColumns)); }

// Splits tiles [0, tiles) over torch's threads in chunks claimed from a shared counter rather than
// in one fixed range per thread: a thread that wakes late or reads memory slower claims fewer
// chunks instead of the other waiting for it at the end (with fixed halves, a 1B model's decode
// step spent 11% of its samples spinning in libgomp). A tile's result does not depend on which
// thread computes it, so the split changes no bit. Chunks are an eighth of a thread's share
// (whole tile groups): long enough that each thread reads its weights in long runs, the way
// one-row kernels stream best (1B Q4_K_M decode step, medians of eight alternated runs: 4-tile
// chunks 25.2 ms, eighths 24.2 ms).
constexpr int64_t kChunksPerThread = 8;
// A prompt's rows are split too when its tiles make few chunks: SmolLM2's 576 columns are 9
// four-tile chunks, which two threads share 5 : 4, so one waited a ninth of the matmul (2-thread
// speedup 1.71x at 200 rows). Halves of the rows double the chunks; each half re-reads the
// chunk's weights, from cache at these sizes. From this many rows per half.
constexpr int64_t kMinRowsPerPart = 32;
// Calls fn(row_begin, row_end, tile_begin, tile_end) over parts covering rows [0, m) x tiles [0, tiles).
template <typename Fn>
void for_tile_chunks(int64_t m, int64_t tiles, int64_t grain, const Fn& fn) {
  const int threads = at::get_num_threads();
  const int64_t share = tiles / (kChunksPerThread * threads) / kGroupTiles * kGroupTiles;
  const int64_t chunk = std::max({grain, kGroupTiles, share});
  if (threads == 1 || (tiles <= chunk && m < 2 * kMinRowsPerPart) || at::in_parallel_region()) {
    fn(0, m, 0, tiles);
    return;
  }
  const int64_t tile_chunks = (tiles + chunk - 1) / chunk;
  const int64_t row_parts = tile_chunks < kChunksPerThread * threads && m >= 2 * kMinRowsPerPart ? 2 : 1;
  const int64_t part_rows = (m + row_parts - 1) / row_parts;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t unit = next.fetch_add(1); unit < tile_chunks * row_parts; unit = next.fetch_add(1)) {
      const int64_t begin = unit / row_parts * chunk, row_begin = unit % row_parts * part_rows;
      fn(row_begin, std::min(m, row_begin + part_rows), begin, std::min(begin + chunk, tiles));
    }
  });
}

// Rows [begin, end) of a problem as a problem of their own (a row's result depends on no other row).
Problem rows_of(Problem p, int64_t begin, int64_t end) {
  p.x += begin * p.x_row_stride;
  p.y += begin * p.y_row_stride;
  p.m = end - begin;
  return p;
}
Int8Problem rows_of(Int8Problem p, int64_t begin, int64_t end) {
  p.xq += begin * p.xq_row_stride;
  p.x_scales += begin * p.blocks_row_stride;
  p.x_sums += begin * p.blocks_row_stride;
  p.x_scaled_sums += begin * p.blocks_row_stride;
  p.x_half_sums += 2 * begin * p.blocks_row_stride;
  p.y += begin * p.y_row_stride;
  p.m = end - begin;
  return p;
}

// x [..., k] as contiguous rows [m, k], and the output y [..., n] both matmuls write.
std::pair<at::Tensor, at::Tensor> matmul_operands(const at::Tensor& x, int64_t n, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) == k,
              "ifb_quant: x must be a CPU float32 tensor [..., ", k, "], got ", x.sizes());
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  return {x.reshape({-1, k}).contiguous(), at::empty(out_shape, x.options())};
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& packed, c10::string_view format_name, int64_t n,
                        int64_t k) {
  const Format format = parse_format(format_name);
  check_packed(packed, format, n, k);
  const auto [rows, y] = matmul_operands(x, n, k);
  const int64_t m = rows.size(0);
  if (m == 0) return y;
  const Problem problem{rows.const_data_ptr<float>(), k, packed.const_data_ptr<uint8_t>(), y.mutable_data_ptr<float>(),
                        n, m, n, k, format};
  for_tile_chunks(m, num_tiles(n), grain_tiles(m, k), [&](int64_t row_begin, int64_t row_end, int64_t begin, int64_t end) {
    run_tiles(rows_of(problem, row_begin, row_end), begin, end);
  });
  return y;
}

// --compute int8: quantize each row of x per 32-block (rows in parallel; each row alone), then
// the integer-dot kernel over column tiles.
at::Tensor quant_matmul_int8(const at::Tensor& x, const at::Tensor& packed, c10::string_view format_name, int64_t n,
                             int64_t k) {
  const Format format = parse_format(format_name);
  check_packed(packed, format, n, k);
  const auto [rows, y] = matmul_operands(x, n, k);
  const int64_t m = rows.size(0);
  if (m == 0) return y;
  const int64_t num_blocks = k / kBlockSize;
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({m, num_blocks}, x.options());
  at::Tensor sums = at::empty({m, num_blocks}, x.options().dtype(at::kInt));
  at::Tensor scaled_sums = at::empty({m, num_blocks}, x.options());
  at::Tensor half_sums = at::empty({m, 2 * num_blocks}, x.options().dtype(at::kInt));
  const Int8Activations activations{xq.mutable_data_ptr<int8_t>(),      k,
                                    scales.mutable_data_ptr<float>(),   sums.mutable_data_ptr<int32_t>(),
                                    scaled_sums.mutable_data_ptr<float>(), half_sums.mutable_data_ptr<int32_t>(),
                                    num_blocks};
  at::parallel_for(0, m, std::max<int64_t>(1, 4096 / k), [&](int64_t begin, int64_t end) {
    quantize_rows_int8(rows.const_data_ptr<float>(), k, k, begin, end, activations);
  });
  const Int8Problem problem{xq.const_data_ptr<int8_t>(), k, scales.const_data_ptr<float>(),
                            sums.const_data_ptr<int32_t>(), scaled_sums.const_data_ptr<float>(),
                            half_sums.const_data_ptr<int32_t>(), num_blocks,
                            packed.const_data_ptr<uint8_t>(), y.mutable_data_ptr<float>(), n, m, n, k, format};
  for_tile_chunks(m, num_tiles(n), grain_tiles(m, k), [&](int64_t row_begin, int64_t row_end, int64_t begin, int64_t end) {
    run_tiles_int8(rows_of(problem, row_begin, row_end), begin, end);
  });
  return y;
}

KvType kv_type(const at::Tensor& pool) {
  switch (pool.scalar_type()) {
    case at::kFloat:
      return KvType::kFloat32;
    case at::kHalf:
      return KvType::kFloat16;
    case at::kBFloat16:
      return KvType::kBFloat16;
    case at::kByte:  // q8_0 rows (plugins/kv_format.py)
      return KvType::kQ8_0;
    default:
      TORCH_CHECK(false, "ifb_quant: KV pools must be float32, float16, bfloat16 or uint8 (q8_0), got ",
                  pool.scalar_type());
  }
}

// One attention contract: what distinguishes a model's attention from plain causal softmax
// attention, as named fields of the op's `variant` string (plugins/attention_variant.py writes it)
// plus the optional sinks tensor. A compiled step calls the shim with these as literals, so a new
// field needs no new C signature: an old package keeps calling the same symbol.
//   window=N   N > 0: each row attends to its last N keys only (sliding-window attention)
//   softcap=C  C > 0: each scaled score s is C * tanh(s / C) (Gemma 2's attention soft-capping)
struct AttentionVariantFields {
  int64_t window = 0;
  double softcap = 0.0;
};

AttentionVariantFields parse_attention_variant(c10::string_view text) {
  AttentionVariantFields fields;
  const std::string all(text);
  size_t begin = 0;
  while (begin < all.size()) {
    const size_t end = std::min(all.find(';', begin), all.size());
    const std::string field = all.substr(begin, end - begin);
    begin = end + 1;
    if (field.empty()) continue;
    const size_t equals = field.find('=');
    TORCH_CHECK(equals != std::string::npos, "ifb_quant: attention variant field '", field, "' is not name=value");
    const std::string name = field.substr(0, equals), value = field.substr(equals + 1);
    size_t used = 0;
    try {
      if (name == "window") {
        fields.window = std::stoll(value, &used);
      } else if (name == "softcap") {
        fields.softcap = std::stod(value, &used);
      } else {
        TORCH_CHECK(false, "ifb_quant: unknown attention variant field '", name, "' (known: window, softcap)");
      }
    } catch (const std::logic_error&) {
      used = 0;
    }
    TORCH_CHECK(used == value.size() && !value.empty(), "ifb_quant: attention variant field ", name,
                " has no number: '", value, "'");
  }
  TORCH_CHECK(fields.window >= 0, "ifb_quant: the sliding window must be >= 0 (0 = none), got ", fields.window);
  TORCH_CHECK(fields.softcap >= 0, "ifb_quant: the attention softcap must be >= 0 (0 = none), got ", fields.softcap);
  return fields;
}

at::Tensor run_paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                               const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                               double scale, const AttentionVariantFields& variant, const float* sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(),
              "ifb_quant: q must be a CPU float32 tensor [rows, heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() &&
                  k_pool.is_contiguous() && v_pool.is_contiguous(),
              "ifb_quant: K/V pools must be contiguous [slots, kv_heads, head_dim] of one dtype");
  const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2), kv_heads = k_pool.size(1);
  const bool supported_dim = head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
  // a q8_0 row: head_dim int8, then an fp16 scale per 32 values (per 16 at head_dim 16)
  const int64_t row = k_pool.scalar_type() == at::kByte ? head_dim + 2 * (head_dim / std::min<int64_t>(head_dim, 32))
                                                        : head_dim;
  TORCH_CHECK(k_pool.size(2) == row && supported_dim && kv_heads > 0 && heads % kv_heads == 0,
              "ifb_quant: head_dim ", head_dim, " must match the pools' rows (", k_pool.size(2),
              ") and be 16, 32, 64, 128 or 256; heads ", heads, " a multiple of kv_heads ", kv_heads);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows && block_tables.scalar_type() == at::kLong &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == rows && seq_lens.scalar_type() == at::kLong,
              "ifb_quant: block_tables [rows, blocks] and seq_lens [rows] must be int64");
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lengths = seq_lens.contiguous();
  const at::Tensor queries = q.contiguous();
  const int64_t* table_data = tables.const_data_ptr<int64_t>();
  const int64_t* length_data = lengths.const_data_ptr<int64_t>();
  const int64_t num_slots = k_pool.size(0);
  for (int64_t r = 0; r < rows; ++r) {  // the kernel trusts these: check once, not per key
    TORCH_CHECK(length_data[r] >= 0 && length_data[r] <= tables.size(1) * block_size,
                "ifb_quant: seq_len ", length_data[r], " exceeds the block table of row ", r);
    for (int64_t b = 0; b < (length_data[r] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table_data[r * tables.size(1) + b] >= 0 && (table_data[r * tables.size(1) + b] + 1) * block_size <= num_slots,
                  "ifb_quant: block ", table_data[r * tables.size(1) + b], " outside the pool");
  }
  at::Tensor out = at::empty({rows, heads, head_dim}, q.options());
  const DecodeAttentionProblem problem{queries.const_data_ptr<float>(), rows, heads, kv_heads, head_dim,
                                       k_pool.const_data_ptr(), v_pool.const_data_ptr(), kv_type(k_pool),
                                       table_data, tables.size(1), length_data, block_size,
                                       static_cast<float>(scale), out.mutable_data_ptr<float>(), variant.window,
                                       static_cast<float>(variant.softcap), sinks};
  const std::vector<AttentionTile> tiles = plan_attention_tiles(problem);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * kv_heads, 1,
                   [&](int64_t begin, int64_t end) { run_paged_attention_items(problem, tiles, begin, end); });
  return out;
}

// The one attention op: `variant` as above; `sinks`, if given, float32 [heads] (gpt-oss).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                           double scale, c10::string_view variant, const std::optional<at::Tensor>& sinks) {
  const AttentionVariantFields fields = parse_attention_variant(variant);
  if (!sinks.has_value()) return run_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, block_size, scale, fields, nullptr);
  TORCH_CHECK(sinks->dim() == 1 && sinks->scalar_type() == at::kFloat && q.dim() == 3 && sinks->size(0) == q.size(1),
              "ifb_quant: attention sinks must be float32 [heads] (", q.dim() == 3 ? q.size(1) : -1, "), got ",
              sinks->scalar_type(), " ", sinks->sizes());
  const at::Tensor sink_logits = sinks->contiguous();
  return run_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, block_size, scale, fields,
                             sink_logits.const_data_ptr<float>());
}

// The three ops engines built before the contract call (through their shims below); kept so
// those engines keep loading. New builds call paged_attention only.
at::Tensor paged_decode_attention_softcap(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                          int64_t block_size, double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "ifb_quant: the sliding window must be >= 0 (0 = none), got ", window);
  TORCH_CHECK(softcap >= 0, "ifb_quant: the attention softcap must be >= 0 (0 = none), got ", softcap);
  return run_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, block_size, scale, {window, softcap}, nullptr);
}

at::Tensor paged_decode_attention_window(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                         int64_t block_size, double scale, int64_t window) {
  return paged_decode_attention_softcap(q, k_pool, v_pool, block_tables, seq_lens, block_size, scale, window, 0.0);
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                                  double scale) {
  return paged_decode_attention_softcap(q, k_pool, v_pool, block_tables, seq_lens, block_size, scale, 0, 0.0);
}

at::Tensor quant_dequantize(const at::Tensor& packed, c10::string_view format_name, int64_t n, int64_t k) {
  const Format format = parse_format(format_name);
  check_packed(packed, format, n, k);
  at::Tensor w = at::empty({n, k}, packed.options().dtype(at::kFloat));
  at::parallel_for(0, num_tiles(n), 1, [&](int64_t begin, int64_t end) {
    dequantize_tiles(packed.const_data_ptr<uint8_t>(), format, n, k, w.mutable_data_ptr<float>(), begin, end);
  });
  return w;
}

// Which packing a compute mode reads: the values of quant_formats.py's WeightCompute.
bool int8_layout(c10::string_view compute) {
  if (compute == "int8") return true;
  TORCH_CHECK(compute == "fp32", "ifb_quant: unknown compute mode '", std::string(compute), "' (fp32, int8)");
  return false;
}

// Rows ids of W [n, k], exact fp32, from tiles packed for `compute` (a tied head's own tiles).
at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& packed, c10::string_view format_name,
                           c10::string_view compute, int64_t n, int64_t k) {
  const Format format = parse_format(format_name);
  const bool int8 = int8_layout(compute);
  check_packed(packed, format, n, k);
  TORCH_CHECK(ids.device().is_cpu() && (ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt),
              "ifb_quant: ids must be a CPU int64 or int32 tensor, got ", ids.scalar_type());
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t count = flat.numel();
  const int64_t* id_data = flat.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)  // the kernel trusts them: one check each, before any read
    TORCH_CHECK(id_data[i] >= 0 && id_data[i] < n, "ifb_quant: embedding id ", id_data[i], " at position ", i,
                " is outside the table of ", n, " rows");
  std::vector<int64_t> out_shape(ids.sizes().begin(), ids.sizes().end());
  out_shape.push_back(k);
  at::Tensor out = at::empty(out_shape, packed.options().dtype(at::kFloat));
  at::parallel_for(0, count, std::max<int64_t>(1, 8192 / k), [&](int64_t begin, int64_t end) {
    gather_rows(packed.const_data_ptr<uint8_t>(), format, int8, n, k, id_data, begin, end, out.mutable_data_ptr<float>());
  });
  return out;
}

}  // namespace
}  // namespace ifb_quant

TORCH_LIBRARY_IMPL(ifb_quant, CPU, m) {
  m.impl("quant_matmul", &ifb_quant::quant_matmul);
  m.impl("quant_matmul_int8", &ifb_quant::quant_matmul_int8);
  m.impl("quant_dequantize", &ifb_quant::quant_dequantize);
  m.impl("quant_embedding", &ifb_quant::quant_embedding);
  m.impl("paged_attention", &ifb_quant::paged_attention);
  m.impl("paged_decode_attention", &ifb_quant::paged_decode_attention);
  m.impl("paged_decode_attention_window", &ifb_quant::paged_decode_attention_window);
  m.impl("paged_decode_attention_softcap", &ifb_quant::paged_decode_attention_softcap);
}

// AOTInductor names a custom op's shim aoti_torch_<device>_<op name> and passes tensors as
// handles, str as const char*, int as int64_t, then one output handle per returned tensor.
namespace {
using MatmulFn = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view, int64_t, int64_t);

// Both matmul shims: unwrap the handles, run the op, hand the result back as a new handle.
AOTITorchError matmul_shim(MatmulFn* op, AtenTensorHandle x, AtenTensorHandle packed, const char* format, int64_t n,
                           int64_t k, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor y = op(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(packed), format, n, k);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(y));
  });
}
}  // namespace

IFB_EXPORT AOTITorchError aoti_torch_cpu_quant_matmul(AtenTensorHandle x, AtenTensorHandle packed,
                                                       const char* format, int64_t n, int64_t k,
                                                       AtenTensorHandle* ret0) {
  return matmul_shim(&ifb_quant::quant_matmul, x, packed, format, n, k, ret0);
}

IFB_EXPORT AOTITorchError aoti_torch_cpu_quant_matmul_int8(AtenTensorHandle x, AtenTensorHandle packed,
                                                            const char* format, int64_t n, int64_t k,
                                                            AtenTensorHandle* ret0) {
  return matmul_shim(&ifb_quant::quant_matmul_int8, x, packed, format, n, k, ret0);
}

// `sinks` is nullptr for None (AOTInductor passes an optional tensor as a pointer to its handle).
IFB_EXPORT AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k_pool,
                                                          AtenTensorHandle v_pool, AtenTensorHandle block_tables,
                                                          AtenTensorHandle seq_lens, int64_t block_size, double scale,
                                                          const char* variant, AtenTensorHandle* sinks,
                                                          AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    std::optional<at::Tensor> sink_logits;
    if (sinks != nullptr) sink_logits = *tensor_handle_to_tensor_pointer(*sinks);
    at::Tensor out = ifb_quant::paged_attention(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k_pool),
        *tensor_handle_to_tensor_pointer(v_pool), *tensor_handle_to_tensor_pointer(block_tables),
        *tensor_handle_to_tensor_pointer(seq_lens), block_size, scale, variant, sink_logits);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

IFB_EXPORT AOTITorchError aoti_torch_cpu_paged_decode_attention(AtenTensorHandle q, AtenTensorHandle k_pool,
                                                                 AtenTensorHandle v_pool, AtenTensorHandle block_tables,
                                                                 AtenTensorHandle seq_lens, int64_t block_size,
                                                                 double scale, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = ifb_quant::paged_decode_attention(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k_pool),
        *tensor_handle_to_tensor_pointer(v_pool), *tensor_handle_to_tensor_pointer(block_tables),
        *tensor_handle_to_tensor_pointer(seq_lens), block_size, scale);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

IFB_EXPORT AOTITorchError aoti_torch_cpu_paged_decode_attention_window(
    AtenTensorHandle q, AtenTensorHandle k_pool, AtenTensorHandle v_pool, AtenTensorHandle block_tables,
    AtenTensorHandle seq_lens, int64_t block_size, double scale, int64_t window, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = ifb_quant::paged_decode_attention_window(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k_pool),
        *tensor_handle_to_tensor_pointer(v_pool), *tensor_handle_to_tensor_pointer(block_tables),
        *tensor_handle_to_tensor_pointer(seq_lens), block_size, scale, window);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

IFB_EXPORT AOTITorchError aoti_torch_cpu_paged_decode_attention_softcap(
    AtenTensorHandle q, AtenTensorHandle k_pool, AtenTensorHandle v_pool, AtenTensorHandle block_tables,
    AtenTensorHandle seq_lens, int64_t block_size, double scale, int64_t window, double softcap,
    AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = ifb_quant::paged_decode_attention_softcap(
        *tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k_pool),
        *tensor_handle_to_tensor_pointer(v_pool), *tensor_handle_to_tensor_pointer(block_tables),
        *tensor_handle_to_tensor_pointer(seq_lens), block_size, scale, window, softcap);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

IFB_EXPORT AOTITorchError aoti_torch_cpu_quant_embedding(AtenTensorHandle ids, AtenTensorHandle packed,
                                                          const char* format, const char* compute, int64_t n,
                                                          int64_t k, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = ifb_quant::quant_embedding(*tensor_handle_to_tensor_pointer(ids),
                                                *tensor_handle_to_tensor_pointer(packed), format, compute, n, k);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}

IFB_EXPORT const char* ifb_quant_int8_dot_path() { return ifb_quant::int8_dot_path(); }

IFB_EXPORT int ifb_quant_one_row_tiles() { return ifb_quant::one_row_tiles(); }

IFB_EXPORT int ifb_quant_wide_one_row_tiles() { return ifb_quant::wide_one_row_tiles(); }

IFB_EXPORT int ifb_quant_set_one_row_tiles(int tiles) { return ifb_quant::set_one_row_tiles(tiles) ? 1 : 0; }

IFB_EXPORT const char* ifb_quant_isa_name() { return ifb_quant::isa_name(); }
