// CPU kernel of the gated MLP activation on raw buffers (no MLX): out = act(gate) * up
// in one pass, act = SiLU (SwiGLU: llama family) or tanh-approximated GELU (GeGLU: gemma).
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

enum class GatedActivation { kSilu, kGeluTanh };

struct SiluAndMulRows {
  Elt elt = Elt::kF32;
  GatedActivation activation = GatedActivation::kSilu;
  const void* gate = nullptr;  // [rows, gate_row_stride]
  const void* up = nullptr;    // [rows, up_row_stride]
  void* out = nullptr;         // [rows, cols]; may be gate or up itself (same strides)
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t gate_row_stride = 0;  // elements
  int64_t up_row_stride = 0;    // elements
};

// silu(g) = g / (1 + e^-g); gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
// = g / (1 + e^(-2 sqrt(2/pi) (g + 0.044715 g^3))). In float32, times up, rounded once to elt.
// Threaded across rows for large inputs; AVX2 when the CPU has it.
void silu_and_mul_rows(const SiluAndMulRows& a);

}  // namespace vllm_metal::cpu
