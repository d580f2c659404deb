// Rotary embedding frequencies: the default table and the scalings of
// HF/vLLM configs (`rope_scaling` / `rope_parameters`), computed on the host in
// double precision. Plain C++ (no MLX): the op turns the result into the
// kernels' turn table (cpu/rope.h), which the CPU and Metal kernels share.
//
// For rotary dimension d and pair i in [0, d/2), theta_i = base^(-2i/d):
//   default  inv_freq_i = theta_i
//   linear   inv_freq_i = theta_i / factor   (positions divided by factor)
//   llama3   with wavelen_i = 2 pi / theta_i, L = original_max_position_embeddings:
//              wavelen_i < L / high_freq_factor  -> theta_i
//              wavelen_i > L / low_freq_factor   -> theta_i / factor
//              otherwise, with s = (L / wavelen_i - low_freq_factor) /
//                                  (high_freq_factor - low_freq_factor):
//                                     (1 - s) theta_i / factor + s theta_i
//   yarn     with corr(b) = d ln(L / (2 pi b)) / (2 ln base),
//              low = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)), d - 1)
//              (no floor/ceil when truncate is false), high += 0.001 if low == high,
//              ramp_i = clamp((i - low) / (high - low), 0, 1),
//              e_i = (1 - ramp_i) * extrapolation_factor:
//                inv_freq_i = theta_i / factor * (1 - e_i) + theta_i * e_i
//            and cos/sin are multiplied by mscale:
//              attention_factor if given, else
//              get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) if both
//              mscale and mscale_all_dim are given and non-zero, else get_mscale(factor),
//              times attn_factor (vLLM's extra multiplier, default 1), where
//              get_mscale(s, m) = 1 if s <= 1 else 0.1 m ln(s) + 1.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace vllm_metal {

enum class RopeScalingType { kDefault, kLinear, kLlama3, kYarn };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kDefault;
  double factor = 1.0;                               // linear, llama3, yarn
  double original_max_position_embeddings = 8192.0;  // llama3, yarn
  double low_freq_factor = 1.0;                      // llama3
  double high_freq_factor = 4.0;                     // llama3
  double beta_fast = 32.0;                           // yarn
  double beta_slow = 1.0;                            // yarn
  double extrapolation_factor = 1.0;                 // yarn (vLLM)
  double attn_factor = 1.0;                          // yarn (vLLM): multiplies mscale
  std::optional<double> mscale;                      // yarn (DeepSeek)
  std::optional<double> mscale_all_dim;              // yarn (DeepSeek)
  std::optional<double> attention_factor;            // yarn (HF): replaces the computed mscale
  bool truncate = true;                              // yarn: floor/ceil the correction range
};

// One value of an HF `rope_scaling` dict: None, a string or a number.
using RopeScalingValue = std::variant<std::monostate, std::string, double>;
using RopeScalingConfig = std::map<std::string, RopeScalingValue>;

// Parses an HF-style dict: "rope_type" (or the older "type"): "default",
// "linear", "llama3" or "yarn", plus that type's numeric keys; None values
// count as absent. Unknown types or keys, missing required keys and
// out-of-range values throw std::invalid_argument("[rope] ...").
RopeScaling parse_rope_scaling(const RopeScalingConfig& config);

const char* rope_scaling_type_name(RopeScalingType type);

struct RopeFrequencies {
  std::vector<double> inv_freq;  // [rotary_dim / 2], radians per position
  double mscale = 1.0;           // multiplies cos and sin
};

// Throws std::invalid_argument("[rope] ...") for rotary_dim not even and
// positive, base not finite and > 0 (> 1 for yarn).
RopeFrequencies rope_frequencies(int64_t rotary_dim, double base, const RopeScaling& scaling);

}  // namespace vllm_metal
