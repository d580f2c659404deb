// CPU kernel of silu_and_mul on raw buffers (no MLX): out = silu(gate) * up,
// the SwiGLU activation of llama-family MLPs, in one pass.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct SiluAndMulRows {
  Elt elt = Elt::kF32;
  const void* gate = nullptr;  // [rows, gate_row_stride]
  const void* up = nullptr;    // [rows, up_row_stride]
  void* out = nullptr;         // [rows, cols]; may be gate or up itself (same strides)
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t gate_row_stride = 0;  // elements
  int64_t up_row_stride = 0;    // elements
};

// silu(g) = g / (1 + e^-g) in float32, times up, rounded once to elt.
// Threaded across rows for large inputs; AVX2 when the CPU has it.
void silu_and_mul_rows(const SiluAndMulRows& a);

}  // namespace vllm_metal::cpu
