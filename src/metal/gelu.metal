// GELU, element by element: x * Phi(x) (erf form, BERT's "gelu") or the tanh
// approximation ("gelu_new"). The same formulas as the CPU kernel (cpu/gelu.h).
#include <metal_stdlib>
#include "gelu_args.h"

using namespace metal;

// Phi(x) = 1 - q (x >= 0) or q (x < 0) with q = 0.5 erfc(|x| / sqrt 2) from Abramowitz &
// Stegun 7.1.26 (|error of erf| <= 1.5e-7); no cancellation for negative x.
inline float gelu_erf(float x) {
  const float z = fabs(x) * 0.70710678118654752f;
  const float t = 1.0f / (1.0f + 0.3275911f * z);
  const float poly =
      t * (0.254829592f +
           t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float q = 0.5f * poly * exp(-z * z);
  return x * (x >= 0.0f ? 1.0f - q : q);
}

// 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3)
inline float gelu_tanh(float x) {
  const float z = -1.5957691216057308f * (x + 0.044715f * x * x * x);
  return x / (1.0f + exp(min(z, 88.0f)));
}

template <typename T>
kernel void gelu(
    device const T* x [[buffer(0)]],
    device T* out [[buffer(1)]],
    constant GeluArgs& args [[buffer(2)]],
    uint i [[thread_position_in_grid]]) {
  if (i < args.count) {
    const float v = float(x[i]);
    out[i] = T(args.approximate != 0u ? gelu_tanh(v) : gelu_erf(v));
  }
}

#define instantiate_gelu(tname, T) \
  template [[host_name("gelu_" #tname)]] kernel decltype(gelu<T>) gelu<T>;

instantiate_gelu(float32, float)
instantiate_gelu(float16, half)
instantiate_gelu(bfloat16, bfloat)
