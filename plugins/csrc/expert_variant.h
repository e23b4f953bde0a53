// The grouped experts op's variant: the activation between an expert's gate/up and its down
// projection, read from named fields (`act=swiglu_clamped;alpha=1.702;limit=7`) so a new variant
// is a field here, never a new op signature. Unknown names and misplaced fields are refused.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace ifb_quant {

// The activation between gate/up and down: plain SwiGLU (silu(gate) * up), or gpt-oss's clamped
// one: gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate)
// (transformers' GptOssExperts._apply_gate).
enum class Act { kSwiglu, kSwigluClamped };

struct Variant {
  Act act = Act::kSwiglu;
  float alpha = 0.0f;
  float limit = 0.0f;
};

inline float parse_number(const std::string& field, const std::string& value) {
  char* end = nullptr;
  const double number = std::strtod(value.c_str(), &end);
  TORCH_CHECK(!value.empty() && end == value.c_str() + value.size() && std::isfinite(number),
              "ifb_quant: grouped_experts variant field '", field, "' needs a finite number, got '", value, "'");
  return static_cast<float>(number);
}

// `name=value` fields separated by ';' ("" is plain SwiGLU); every name known, none repeated,
// alpha and limit given exactly where the activation takes them.
inline Variant parse_variant(c10::string_view text) {
  Variant variant;
  bool has_alpha = false, has_limit = false, has_act = false;
  const std::string all(text);
  size_t begin = 0;
  while (begin < all.size()) {
    size_t end = all.find(';', begin);
    if (end == std::string::npos) end = all.size();
    const std::string field = all.substr(begin, end - begin);
    begin = end + 1;
    const size_t eq = field.find('=');
    TORCH_CHECK(eq != std::string::npos, "ifb_quant: grouped_experts variant field '", field, "' is not name=value");
    const std::string name = field.substr(0, eq), value = field.substr(eq + 1);
    if (name == "act") {
      TORCH_CHECK(!has_act, "ifb_quant: grouped_experts variant repeats 'act'");
      has_act = true;
      if (value == "swiglu")
        variant.act = Act::kSwiglu;
      else if (value == "swiglu_clamped")
        variant.act = Act::kSwigluClamped;
      else
        TORCH_CHECK(false, "ifb_quant: unknown grouped_experts activation '", value, "' (swiglu, swiglu_clamped)");
    } else if (name == "alpha") {
      TORCH_CHECK(!has_alpha, "ifb_quant: grouped_experts variant repeats 'alpha'");
      has_alpha = true, variant.alpha = parse_number(name, value);
    } else if (name == "limit") {
      TORCH_CHECK(!has_limit, "ifb_quant: grouped_experts variant repeats 'limit'");
      has_limit = true, variant.limit = parse_number(name, value);
    } else {
      TORCH_CHECK(false, "ifb_quant: unknown grouped_experts variant field '", name, "' (act, alpha, limit)");
    }
  }
  const bool clamped = variant.act == Act::kSwigluClamped;
  TORCH_CHECK(has_alpha == clamped && has_limit == clamped, "ifb_quant: grouped_experts variant '", all,
              "': alpha and limit go with act=swiglu_clamped, and only with it");
  return variant;
}

// act[i, c] from row i's gate (columns [0, I)) and up (columns [I, 2I)) outputs
inline void activate(const Variant& variant, const float* hidden_up, int64_t m, int64_t intermediate, float* act) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t c = 0; c < intermediate; ++c) {
      float g = hidden_up[i * 2 * intermediate + c], u = hidden_up[i * 2 * intermediate + intermediate + c];
      if (variant.act == Act::kSwiglu) {
        act[i * intermediate + c] = g / (1.0f + std::exp(-g)) * u;  // silu(gate) * up
        continue;
      }
      g = std::min(g, variant.limit);  // NaN stays NaN, as torch.clamp
      u = std::max(std::min(u, variant.limit), -variant.limit);
      act[i * intermediate + c] = (u + 1.0f) * (g / (1.0f + std::exp(-g * variant.alpha)));
    }
}

}  // namespace ifb_quant
