#include "ops/rope_scaling.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <stdexcept>

namespace vllm_metal {

namespace {

constexpr double kPi = 3.14159265358979323846;

[[noreturn]] void fail(const std::string& msg) {
  throw std::invalid_argument("[rope] " + msg);
}

std::string num_str(double v) {
  std::string s = std::to_string(v);
  if (s.find('.') != std::string::npos) {
    s.erase(s.find_last_not_of('0') + 1);
    if (s.back() == '.') s.pop_back();
  }
  return s;
}

std::string join(const std::set<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "" : ", ") + k;
  return out.empty() ? "none" : out;
}

// The keys each type accepts (besides rope_type/type), and those it requires.
struct TypeKeys {
  std::set<std::string> allowed;
  std::set<std::string> required;
};

TypeKeys keys_of(RopeScalingType type) {
  switch (type) {
    case RopeScalingType::kDefault: return {{}, {}};
    case RopeScalingType::kLinear: return {{"factor"}, {"factor"}};
    case RopeScalingType::kLlama3: {
      std::set<std::string> k = {"factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings"};
      return {k, k};
    }
    case RopeScalingType::kYarn:
      return {{"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
               "extrapolation_factor", "attn_factor", "mscale", "mscale_all_dim",
               "attention_factor", "truncate"},
              {"factor", "original_max_position_embeddings"}};
  }
  return {};
}

RopeScalingType parse_type(const std::string& name) {
  if (name == "default") return RopeScalingType::kDefault;
  if (name == "linear") return RopeScalingType::kLinear;
  if (name == "llama3") return RopeScalingType::kLlama3;
  if (name == "yarn") return RopeScalingType::kYarn;
  fail("unsupported scaling type '" + name + "' (supported: default, linear, llama3, yarn)");
}

void check_positive(const char* what, double v) {
  if (!std::isfinite(v) || v <= 0) {
    fail(std::string("scaling ") + what + " must be finite and > 0, got " + num_str(v));
  }
}

void check_finite(const char* what, double v) {
  if (!std::isfinite(v)) fail(std::string("scaling ") + what + " must be finite");
}

void check_values(const RopeScaling& s) {
  if (s.type == RopeScalingType::kDefault) return;
  check_positive("factor", s.factor);
  if (s.type == RopeScalingType::kLinear) return;
  check_positive("original_max_position_embeddings", s.original_max_position_embeddings);
  if (s.type == RopeScalingType::kLlama3) {
    check_positive("low_freq_factor", s.low_freq_factor);
    check_positive("high_freq_factor", s.high_freq_factor);
    if (!(s.high_freq_factor > s.low_freq_factor)) {
      fail("scaling high_freq_factor (" + num_str(s.high_freq_factor) +
           ") must be greater than low_freq_factor (" + num_str(s.low_freq_factor) + ")");
    }
    return;
  }
  check_positive("beta_fast", s.beta_fast);
  check_positive("beta_slow", s.beta_slow);
  check_finite("extrapolation_factor", s.extrapolation_factor);
  check_positive("attn_factor", s.attn_factor);
  if (s.mscale) check_finite("mscale", *s.mscale);
  if (s.mscale_all_dim) check_finite("mscale_all_dim", *s.mscale_all_dim);
  if (s.attention_factor) check_positive("attention_factor", *s.attention_factor);
}

// yarn's attention scaling of one factor (HF get_mscale / vLLM yarn_get_mscale).
double get_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// Dimension (fractional) whose wavelength makes `rotations` turns over `max_pos`.
double yarn_correction_dim(double rotations, double dim, double base, double max_pos) {
  return dim * std::log(max_pos / (rotations * 2.0 * kPi)) / (2.0 * std::log(base));
}

}  // namespace

const char* rope_scaling_type_name(RopeScalingType type) {
  switch (type) {
    case RopeScalingType::kDefault: return "default";
    case RopeScalingType::kLinear: return "linear";
    case RopeScalingType::kLlama3: return "llama3";
    case RopeScalingType::kYarn: return "yarn";
  }
  return "unknown";
}

RopeScaling parse_rope_scaling(const RopeScalingConfig& config) {
  // None values count as absent (HF dicts carry e.g. "mscale": None).
  std::map<std::string, RopeScalingValue> present;
  for (const auto& [k, v] : config) {
    if (!std::holds_alternative<std::monostate>(v)) present.emplace(k, v);
  }
  std::string type_name;
  for (const char* key : {"rope_type", "type"}) {
    auto it = present.find(key);
    if (it == present.end()) continue;
    if (!std::holds_alternative<std::string>(it->second)) {
      fail(std::string("scaling '") + key + "' must be a string");
    }
    const auto& name = std::get<std::string>(it->second);
    if (!type_name.empty() && name != type_name) {
      fail("scaling 'rope_type' ('" + type_name + "') and 'type' ('" + name + "') disagree");
    }
    type_name = name;
    present.erase(it);
  }
  if (type_name.empty()) {
    if (!present.empty()) fail("scaling needs a 'rope_type' (default, linear, llama3 or yarn)");
    type_name = "default";
  }
  RopeScaling s;
  s.type = parse_type(type_name);
  const TypeKeys keys = keys_of(s.type);
  for (const auto& k : keys.required) {
    if (!present.count(k)) fail(type_name + " scaling requires '" + k + "'");
  }
  for (const auto& [k, v] : present) {
    if (!keys.allowed.count(k)) {
      fail("unknown key '" + k + "' for " + type_name + " scaling (accepted: " +
           join(keys.allowed) + ")");
    }
    if (!std::holds_alternative<double>(v)) {
      fail("scaling '" + k + "' must be a number, got a string");
    }
    const double x = std::get<double>(v);
    if (k == "factor") s.factor = x;
    else if (k == "original_max_position_embeddings") s.original_max_position_embeddings = x;
    else if (k == "low_freq_factor") s.low_freq_factor = x;
    else if (k == "high_freq_factor") s.high_freq_factor = x;
    else if (k == "beta_fast") s.beta_fast = x;
    else if (k == "beta_slow") s.beta_slow = x;
    else if (k == "extrapolation_factor") s.extrapolation_factor = x;
    else if (k == "attn_factor") s.attn_factor = x;
    else if (k == "mscale") s.mscale = x;
    else if (k == "mscale_all_dim") s.mscale_all_dim = x;
    else if (k == "attention_factor") s.attention_factor = x;
    else if (k == "truncate") s.truncate = x != 0.0;
  }
  check_values(s);
  return s;
}

RopeFrequencies rope_frequencies(int64_t rotary_dim, double base, const RopeScaling& s) {
  if (rotary_dim < 2 || rotary_dim % 2 != 0) {
    fail("rotary_dim must be even and >= 2, got " + std::to_string(rotary_dim));
  }
  if (!std::isfinite(base) || base <= 0) fail("base must be finite and > 0, got " + num_str(base));
  if (s.type == RopeScalingType::kYarn && base <= 1) {
    fail("yarn scaling needs base > 1, got " + num_str(base));
  }
  check_values(s);
  const int64_t half = rotary_dim / 2;
  const double dim = static_cast<double>(rotary_dim);
  RopeFrequencies f;
  f.inv_freq.resize(half);
  for (int64_t i = 0; i < half; ++i) {
    f.inv_freq[i] = std::pow(base, -2.0 * static_cast<double>(i) / dim);
  }
  switch (s.type) {
    case RopeScalingType::kDefault:
      break;
    case RopeScalingType::kLinear:
      for (auto& v : f.inv_freq) v /= s.factor;
      break;
    case RopeScalingType::kLlama3: {
      const double L = s.original_max_position_embeddings;
      const double low_freq_wavelen = L / s.low_freq_factor;
      const double high_freq_wavelen = L / s.high_freq_factor;
      for (auto& v : f.inv_freq) {
        const double wavelen = 2.0 * kPi / v;
        if (wavelen < high_freq_wavelen) continue;  // high frequencies: unchanged
        if (wavelen > low_freq_wavelen) {
          v /= s.factor;  // low frequencies: interpolated
          continue;
        }
        const double smooth =
            (L / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        v = (1.0 - smooth) * v / s.factor + smooth * v;
      }
      break;
    }
    case RopeScalingType::kYarn: {
      const double L = s.original_max_position_embeddings;
      double low = yarn_correction_dim(s.beta_fast, dim, base, L);
      double high = yarn_correction_dim(s.beta_slow, dim, base, L);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1.0);
      if (low == high) high += 0.001;  // avoid a division by zero in the ramp
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation = (1.0 - ramp) * s.extrapolation_factor;
        const double theta = f.inv_freq[i];
        f.inv_freq[i] = theta / s.factor * (1.0 - extrapolation) + theta * extrapolation;
      }
      if (s.attention_factor) {
        f.mscale = *s.attention_factor;
      } else if (s.mscale && s.mscale_all_dim && *s.mscale != 0 && *s.mscale_all_dim != 0) {
        f.mscale = get_mscale(s.factor, *s.mscale) / get_mscale(s.factor, *s.mscale_all_dim);
      } else {
        f.mscale = get_mscale(s.factor, 1.0);
      }
      f.mscale *= s.attn_factor;
      break;
    }
  }
  return f;
}

}  // namespace vllm_metal
