// GELU, element by element: x * Phi(x) (erf form, BERT's "gelu") or the tanh
// approximation ("gelu_new"). The same formulas as the CPU kernel (cpu/gelu.h).
#include <metal_stdlib>
#include "gelu_args.h"
#include "gelu_core.h"

using namespace metal;

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
