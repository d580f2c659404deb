// GELU on one float32 value, shared by the gelu kernel and the gguf_matmul epilogue; the
// same formulas as the CPU kernel (cpu/gelu.h).
#pragma once

#include <metal_stdlib>

// Phi(x) = 1 - q (x >= 0) or q (x < 0) with q = 0.5 erfc(|x| / sqrt 2) from Abramowitz &
// Stegun 7.1.26 (|error of erf| <= 1.5e-7); no cancellation for negative x.
inline float gelu_erf(float x) {
  const float z = metal::fabs(x) * 0.70710678118654752f;
  const float t = 1.0f / (1.0f + 0.3275911f * z);
  const float poly =
      t * (0.254829592f +
           t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float q = 0.5f * poly * metal::exp(-z * z);
  return x * (x >= 0.0f ? 1.0f - q : q);
}

// 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3)
inline float gelu_tanh(float x) {
  const float z = -1.5957691216057308f * (x + 0.044715f * x * x * x);
  return x / (1.0f + metal::exp(metal::min(z, 88.0f)));
}
