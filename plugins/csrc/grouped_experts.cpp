// The mixture-of-experts layer as one op: a step's rows grouped by expert, each selected expert's
// weights read once for all of its rows, experts no row selected not touched.
//
// y[r] = sum over r's top-k slots j, in ascending expert id, of w[r, j] * down_e(act(gate_e(x[r]), up_e(x[r])))
// with e = ids[r, j] (transformers' Qwen3MoeExperts adds the experts' outputs in that order).
// `grouped_experts` is act = silu(gate) * up, no biases. `grouped_experts_variant` takes the variant
// as named fields (`act=swiglu_clamped;alpha=1.702;limit=7`, parsed here, unknown names refused) and
// optional per-expert biases added to gate/up's and down's outputs (gpt-oss), so the next variant
// is a field, not a new signature.
// x and w are float32, or both a 16-bit engine's dtype: widened exactly, summed in float32, y rounded
// to x's dtype at the end (a compiled graph that did these casts itself could fuse them away:
// AOTInductor computes across a bf16 -> fp32 round trip without rounding, unlike the eager network).
//
// Each expert's rows are gathered into a contiguous block and multiplied by the expert's weights
// with the engine's own per-format matmul (quant_matmul.cpp / quant_matmul_int8.cpp: run_tiles and
// run_tiles_int8, batch invariant by construction), so a row's result is bitwise the same whatever
// other rows share its experts. Dense (fp32) experts take a plain loop with the same property: one
// serial fp32 chain per output element, k = 0..K-1 (compiled with -ffp-contract=off and no
// reassociation, so no vectorizer reorders a chain). Threads split output columns only.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "expert_variant.h"
#include "quant_kernels.h"

#define IFB_EXPORT extern "C" __attribute__((visibility("default")))

namespace ifb_quant {
namespace {

constexpr const char* kDense = "fp32";  // quant_formats.py's WeightFormat.FP32: a float tensor [E, n, k]

// A stacked expert weight: dense [E, n, k] (float32, or a 16-bit engine's bfloat16/float16, each
// weight widened exactly), or per-expert packed tiles uint8 [E, tiles, bytes].
struct ExpertWeights {
  bool dense;
  at::ScalarType dense_type;
  Format format;  // block formats only
  const uint8_t* data;
  int64_t expert_bytes;  // bytes of one expert's weights
  int64_t n;
  int64_t k;
};

ExpertWeights expert_weights(const at::Tensor& w, c10::string_view format_name, int64_t num_experts, int64_t n,
                             int64_t k, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() >= 1 && w.size(0) == num_experts,
              "ifb_quant: ", what, " must be a contiguous CPU tensor with ", num_experts, " experts, got ", w.sizes());
  if (format_name == kDense) {
    const at::ScalarType type = w.scalar_type();
    const bool floating = type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
    TORCH_CHECK(floating && w.dim() == 3 && w.size(1) == n && w.size(2) == k, "ifb_quant: dense ", what,
                " must be float32, bfloat16 or float16 [", num_experts, ", ", n, ", ", k, "], got ", type, " ", w.sizes());
    return {true, type, Format{}, static_cast<const uint8_t*>(w.const_data_ptr()), n * k * w.element_size(), n, k};
  }
  Format format{};
  bool known = false;
  for (const FormatInfo& info : kFormats)
    if (format_name == info.name) format = info.format, known = true;
  TORCH_CHECK(known, "ifb_quant: unknown expert weight format '", std::string(format_name), "'");
  const int64_t weights = block_weights(format);
  TORCH_CHECK(k % weights == 0, "ifb_quant: ", what, " K=", k, " is not a multiple of ", format_info(format).name,
              "'s ", weights, "-weight block");
  const int64_t bytes = num_tiles(n) * (k / weights) * kTileColumns * block_bytes(format);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.numel() == num_experts * bytes, "ifb_quant: packed ", what, " holds ",
              w.numel(), " bytes, expected ", num_experts, " x ", bytes);
  return {false, at::kByte, format, w.const_data_ptr<uint8_t>(), bytes, n, k};
}

// Output columns [begin, end) of y[m, n] = x[m, k] @ W^T for a dense W [n, k]: one serial chain
// each, fp32, every weight widened exactly (a 16-bit row is widened once for all m rows).
template <typename T>
void dense_columns(const float* x, int64_t m, const T* w, int64_t n, int64_t k, float* y, int64_t begin,
                   int64_t end) {
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t j = begin; j < end; ++j) {
    for (int64_t i = 0; i < k; ++i) row[i] = static_cast<float>(w[j * k + i]);
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i) acc += xr[i] * row[i];
      y[r * n + j] = acc;
    }
  }
}

// The step's selected rows for one matmul phase, in expert order: row i is source row
// `source_rows[i]` (nullptr: row i), as fp32 rows for the fp32 kernels and dense experts, or
// quantized per row for int8 compute (each row as the dense int8 kernels quantize it).
class PhaseRows {
 public:
  PhaseRows(const float* source, int64_t k, int64_t count, const int64_t* source_rows, bool int8)
      : int8_(int8), k_(k), blocks_(k / kBlockSize) {
    const auto source_row = [&](int64_t i) { return source + (source_rows ? source_rows[i] : i) * k; };
    if (!int8) {
      if (source_rows == nullptr) {
        x_ = source;
        return;
      }
      gathered_.resize(static_cast<size_t>(count * k));
      for (int64_t i = 0; i < count; ++i) std::copy_n(source_row(i), k, gathered_.data() + i * k);
      x_ = gathered_.data();
      return;
    }
    xq_.resize(static_cast<size_t>(count * k));
    scales_.resize(static_cast<size_t>(count * blocks_));
    scaled_sums_.resize(scales_.size());
    sums_.resize(scales_.size());
    half_sums_.resize(2 * scales_.size());
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) quantize_rows_int8(source_row(i), k, k, 0, 1, activations(i));
    });
  }

  // y rows [row_begin, row_begin + m) = these rows @ W^T, tiles [tile_begin, tile_end) of W (dense
  // weights: the same columns, 16 a tile, each a serial fp32 chain).
  void multiply(const ExpertWeights& w, int64_t expert, int64_t row_begin, int64_t m, float* y, int64_t tile_begin,
                int64_t tile_end) const {
    const uint8_t* weights = w.data + expert * w.expert_bytes;
    const int64_t n = w.n, k = w.k;
    float* rows_y = y + row_begin * n;
    if (w.dense) {
      const int64_t begin = tile_begin * kTileColumns, end = std::min(tile_end * kTileColumns, n);
      const float* x = x_ + row_begin * k;
      if (w.dense_type == at::kBFloat16)
        dense_columns(x, m, reinterpret_cast<const c10::BFloat16*>(weights), n, k, rows_y, begin, end);
      else if (w.dense_type == at::kHalf)
        dense_columns(x, m, reinterpret_cast<const c10::Half*>(weights), n, k, rows_y, begin, end);
      else
        dense_columns(x, m, reinterpret_cast<const float*>(weights), n, k, rows_y, begin, end);
      return;
    }
    if (!int8_) {
      run_tiles(Problem{x_ + row_begin * k, k, weights, rows_y, n, m, n, k, w.format}, tile_begin, tile_end);
      return;
    }
    const Int8Problem problem{xq_.data() + row_begin * k,
                              k,
                              scales_.data() + row_begin * blocks_,
                              sums_.data() + row_begin * blocks_,
                              scaled_sums_.data() + row_begin * blocks_,
                              half_sums_.data() + 2 * row_begin * blocks_,
                              blocks_,
                              weights,
                              rows_y,
                              n,
                              m,
                              n,
                              k,
                              w.format};
    run_tiles_int8(problem, tile_begin, tile_end);
  }

 private:
  // Where row `row`'s int8 form is written (quantize_rows_int8's output, from that row on)
  Int8Activations activations(int64_t row) {
    return {xq_.data() + row * k_,
            k_,
            scales_.data() + row * blocks_,
            sums_.data() + row * blocks_,
            scaled_sums_.data() + row * blocks_,
            half_sums_.data() + 2 * row * blocks_,
            blocks_};
  }

  bool int8_;
  int64_t k_, blocks_;
  const float* x_ = nullptr;
  std::vector<float> gathered_;
  std::vector<int8_t> xq_;
  std::vector<float> scales_, scaled_sums_;
  std::vector<int32_t> sums_, half_sums_;
};

// Runs `tiles_of(e, row_begin, m, tile_begin, tile_end)` over every selected expert's column tiles
// (`tiles` per expert) in ONE parallel region: the tiles are cut in kGroupTiles units, in expert
// order, and each thread takes a contiguous run of about equal work (units x the expert's rows),
// consecutive units of one expert as one call. One region per expert and matmul was 16 regions a
// layer at batch 1 (Qwen3-30B-A3B: 8 experts x gate/up and down), each join waiting on the slower
// thread: with the machine loaded (a test run and two busy loops on 2 cores) the op's median at
// batch 1 was 10 ms on 2 threads against 5.9 ms on one. Each row's result is the same whichever
// thread computes a tile (tiles are independent), so the bits do not change.
template <typename Fn>
void for_expert_tiles(const std::vector<int64_t>& count, int64_t tiles, const Fn& tiles_of) {
  struct Unit {
    int64_t expert, tile_begin, tile_end;
  };
  std::vector<Unit> units;
  std::vector<int64_t> work_before{0};  // work_before[u]: the work of units [0, u)
  const int64_t num_experts = static_cast<int64_t>(count.size()) - 1;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t m = count[e + 1] - count[e];
    if (m == 0) continue;  // no row chose it: its weights are not read
    for (int64_t t = 0; t < tiles; t += kGroupTiles) {
      units.push_back({e, t, std::min(t + kGroupTiles, tiles)});
      work_before.push_back(work_before.back() + m);
    }
  }
  const int64_t num_units = static_cast<int64_t>(units.size()), total = work_before.back();
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), num_units);
  if (parts == 0) return;
  // unit u goes to part floor(work_before[u] * parts / total): the first unit of part p is the
  // first whose work_before * parts reaches p * total
  const auto first_unit = [&](int64_t part) {
    return static_cast<int64_t>(std::partition_point(work_before.begin(), work_before.begin() + num_units,
                                                     [&](int64_t w) { return w * parts < part * total; }) -
                                work_before.begin());
  };
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    for (int64_t u = first_unit(part_begin), end = first_unit(part_end); u < end;) {
      const int64_t e = units[u].expert, tile_begin = units[u].tile_begin;
      int64_t tile_end = units[u].tile_end;
      for (++u; u < end && units[u].expert == e; ++u) tile_end = units[u].tile_end;
      tiles_of(e, count[e], count[e + 1] - count[e], tile_begin, tile_end);
    }
  });
}

bool is_activation_type(at::ScalarType type) {
  return type == at::kFloat || type == at::kBFloat16 || type == at::kHalf;
}

bool int8_compute(c10::string_view compute) {
  if (compute == "int8") return true;
  TORCH_CHECK(compute == "fp32", "ifb_quant: unknown compute mode '", std::string(compute), "' (fp32, int8)");
  return false;
}

// An optional per-expert bias [E, width] as float32 (16-bit ones widened exactly); empty: none.
at::Tensor expert_bias(const std::optional<at::Tensor>& bias, int64_t num_experts, int64_t width, const char* what) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  const at::Tensor& b = *bias;
  TORCH_CHECK(b.device().is_cpu() && is_activation_type(b.scalar_type()) && b.dim() == 2 && b.size(0) == num_experts &&
                  b.size(1) == width,
              "ifb_quant: ", what, " must be a CPU float tensor [", num_experts, ", ", width, "], got ", b.scalar_type(),
              " ", b.sizes());
  return b.to(at::kFloat).contiguous();
}

// y[i, c] += bias[c] for the m rows of one expert (nothing where there is no bias)
void add_bias(const at::Tensor& bias, int64_t expert, float* y, int64_t m, int64_t width) {
  if (!bias.defined()) return;
  const float* b = bias.const_data_ptr<float>() + expert * width;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < width; ++c) y[i * width + c] += b[c];
}

at::Tensor run_grouped_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights_,
                               const at::Tensor& gate_up, const at::Tensor& down, c10::string_view gate_up_format,
                               c10::string_view down_format, c10::string_view compute, int64_t intermediate,
                               const Variant& variant, const std::optional<at::Tensor>& gate_up_bias_,
                               const std::optional<at::Tensor>& down_bias_) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && is_activation_type(dtype) && x.dim() == 2,
              "ifb_quant: x must be a CPU float32, bfloat16 or float16 tensor [rows, hidden], got ", dtype, " ",
              x.sizes());
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(expert_ids.scalar_type() == at::kLong && expert_ids.dim() == 2 && expert_ids.size(0) == rows,
              "ifb_quant: expert_ids must be int64 [", rows, ", top_k], got ", expert_ids.sizes());
  const int64_t top_k = expert_ids.size(1);
  TORCH_CHECK(expert_weights_.scalar_type() == dtype && expert_weights_.sizes() == expert_ids.sizes(),
              "ifb_quant: expert_weights must be ", dtype, " (x's dtype) ", expert_ids.sizes(), ", got ",
              expert_weights_.scalar_type(), " ", expert_weights_.sizes());
  const int64_t num_experts = gate_up.dim() >= 1 ? gate_up.size(0) : 0;
  TORCH_CHECK(intermediate > 0 && num_experts > 0, "ifb_quant: need experts and intermediate > 0");
  const bool int8 = int8_compute(compute);
  const ExpertWeights up = expert_weights(gate_up, gate_up_format, num_experts, 2 * intermediate, hidden, "gate_up");
  const ExpertWeights dn = expert_weights(down, down_format, num_experts, hidden, intermediate, "down");
  const at::Tensor gate_up_bias = expert_bias(gate_up_bias_, num_experts, 2 * intermediate, "gate_up_bias");
  const at::Tensor down_bias = expert_bias(down_bias_, num_experts, hidden, "down_bias");
  TORCH_CHECK(!int8 || (!up.dense && !dn.dense), "ifb_quant: int8 compute needs block-format expert weights");
  // 16-bit activations and routing weights are widened exactly (no copy for float32); the sums run
  // in float32 and the result is rounded to x's dtype once, here, where no compiler can drop it
  const at::Tensor xs = x.to(at::kFloat).contiguous(), ids = expert_ids.contiguous();
  const at::Tensor ws = expert_weights_.to(at::kFloat).contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  // The rows of each expert, in row order (a counting sort): slot r * top_k + j of row r
  std::vector<int64_t> count(static_cast<size_t>(num_experts) + 1, 0);
  for (int64_t s = 0; s < rows * top_k; ++s) {
    TORCH_CHECK(id[s] >= 0 && id[s] < num_experts, "ifb_quant: expert id ", id[s], " of row ", s / top_k,
                " is outside [0, ", num_experts, ")");
    ++count[static_cast<size_t>(id[s]) + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];
  std::vector<int64_t> slots(static_cast<size_t>(rows * top_k));
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t s = 0; s < rows * top_k; ++s) slots[next[id[s]]++] = s;
  // Every selected row through gate/up, the activation and down, each phase one parallel region over
  // all selected experts' tiles (for_expert_tiles); rows stay in expert order, row i being slot slots[i]
  const int64_t selected = rows * top_k;
  std::vector<int64_t> token_of(static_cast<size_t>(selected));
  for (int64_t i = 0; i < selected; ++i) token_of[i] = slots[i] / top_k;
  std::vector<float> hidden_up(static_cast<size_t>(selected * 2 * intermediate));
  {
    const PhaseRows gate_up_rows(xs.const_data_ptr<float>(), hidden, selected, token_of.data(), int8);
    for_expert_tiles(count, num_tiles(2 * intermediate), [&](int64_t e, int64_t row_begin, int64_t m, int64_t t0,
                                                              int64_t t1) {
      gate_up_rows.multiply(up, e, row_begin, m, hidden_up.data(), t0, t1);
    });
  }
  std::vector<float> act(static_cast<size_t>(selected * intermediate));
  at::parallel_for(0, selected, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = hidden_up.data() + i * 2 * intermediate;
      add_bias(gate_up_bias, id[slots[i]], row, 1, 2 * intermediate);
      activate(variant, row, 1, intermediate, act.data() + i * intermediate);
    }
  });
  std::vector<float>().swap(hidden_up);
  std::vector<float> expert_out(static_cast<size_t>(selected * hidden));  // each selected row's expert output
  {
    const PhaseRows down_rows(act.data(), intermediate, selected, nullptr, int8);
    for_expert_tiles(count, num_tiles(hidden), [&](int64_t e, int64_t row_begin, int64_t m, int64_t t0, int64_t t1) {
      down_rows.multiply(dn, e, row_begin, m, expert_out.data(), t0, t1);
    });
  }
  std::vector<int64_t> position(static_cast<size_t>(selected));  // slot -> its row in expert order
  for (int64_t i = 0; i < selected; ++i) {
    position[slots[i]] = i;
    add_bias(down_bias, id[slots[i]], expert_out.data() + i * hidden, 1, hidden);
  }
  // Each row's weighted sum over its slots in ascending expert id: depends on that row only
  at::Tensor y = at::empty({rows, hidden}, xs.options());
  float* yd = y.mutable_data_ptr<float>();
  const float* wd = ws.const_data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t row_begin, int64_t row_end) {
    std::vector<int64_t> order(static_cast<size_t>(top_k));
    for (int64_t r = row_begin; r < row_end; ++r) {
      for (int64_t j = 0; j < top_k; ++j) order[j] = r * top_k + j;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
      float* yr = yd + r * hidden;
      std::fill_n(yr, hidden, 0.0f);
      for (const int64_t s : order)
        for (int64_t c = 0; c < hidden; ++c) yr[c] += expert_out[position[s] * hidden + c] * wd[s];
    }
  });
  return y.to(dtype);
}

at::Tensor grouped_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                           const at::Tensor& gate_up, const at::Tensor& down, c10::string_view gate_up_format,
                           c10::string_view down_format, c10::string_view compute, int64_t intermediate) {
  return run_grouped_experts(x, expert_ids, expert_weights, gate_up, down, gate_up_format, down_format, compute,
                             intermediate, Variant{}, std::nullopt, std::nullopt);
}

at::Tensor grouped_experts_variant(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                                   const at::Tensor& gate_up, const at::Tensor& down, c10::string_view gate_up_format,
                                   c10::string_view down_format, c10::string_view compute, int64_t intermediate,
                                   c10::string_view variant, const std::optional<at::Tensor>& gate_up_bias,
                                   const std::optional<at::Tensor>& down_bias) {
  return run_grouped_experts(x, expert_ids, expert_weights, gate_up, down, gate_up_format, down_format, compute,
                             intermediate, parse_variant(variant), gate_up_bias, down_bias);
}

}  // namespace
}  // namespace ifb_quant

TORCH_LIBRARY_IMPL(ifb_quant, CPU, m) {
  m.impl("grouped_experts", &ifb_quant::grouped_experts);
  m.impl("grouped_experts_variant", &ifb_quant::grouped_experts_variant);
}

IFB_EXPORT AOTITorchError aoti_torch_cpu_grouped_experts(AtenTensorHandle x, AtenTensorHandle expert_ids,
                                                          AtenTensorHandle expert_weights, AtenTensorHandle gate_up,
                                                          AtenTensorHandle down, const char* gate_up_format,
                                                          const char* down_format, const char* compute,
                                                          int64_t intermediate, AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor y = ifb_quant::grouped_experts(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(expert_ids),
        *tensor_handle_to_tensor_pointer(expert_weights), *tensor_handle_to_tensor_pointer(gate_up),
        *tensor_handle_to_tensor_pointer(down), gate_up_format, down_format, compute, intermediate);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(y));
  });
}

// Optional tensors come as a pointer to a handle, nullptr for None (AOTInductor's cpp wrapper).
IFB_EXPORT AOTITorchError aoti_torch_cpu_grouped_experts_variant(
    AtenTensorHandle x, AtenTensorHandle expert_ids, AtenTensorHandle expert_weights, AtenTensorHandle gate_up,
    AtenTensorHandle down, const char* gate_up_format, const char* down_format, const char* compute,
    int64_t intermediate, const char* variant, AtenTensorHandle* gate_up_bias, AtenTensorHandle* down_bias,
    AtenTensorHandle* ret0) {
  using torch::aot_inductor::tensor_handle_to_tensor_pointer;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    const auto optional = [](AtenTensorHandle* handle) -> std::optional<at::Tensor> {
      if (handle == nullptr) return std::nullopt;
      return *tensor_handle_to_tensor_pointer(*handle);
    };
    at::Tensor y = ifb_quant::grouped_experts_variant(
        *tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(expert_ids),
        *tensor_handle_to_tensor_pointer(expert_weights), *tensor_handle_to_tensor_pointer(gate_up),
        *tensor_handle_to_tensor_pointer(down), gate_up_format, down_format, compute, intermediate, variant,
        optional(gate_up_bias), optional(down_bias));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(y));
  });
}
