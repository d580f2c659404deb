// CPU kernel of gelu on raw buffers (no MLX): y = x * Phi(x) (erf GELU) or the tanh
// approximation, in float32, rounded once to elt. Formulas: src/metal/gelu.metal
// (Phi from Abramowitz & Stegun 7.1.26, |erf error| <= 1.5e-7). Threaded, AVX2 when
// the CPU has it: MLX's CPU erf and exp are scalar (~50 ns an element).
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

void gelu(Elt elt, const void* x, void* out, int64_t count, bool approximate);

// The same on float32 in place, on the calling thread (GEMM epilogues: cpu/gguf_matmul.h).
void gelu_inplace_f32(float* y, int64_t count, bool approximate);

}  // namespace vllm_metal::cpu
