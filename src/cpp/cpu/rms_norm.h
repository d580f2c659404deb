// CPU kernel of rms_norm / add_rms_norm on raw row-major buffers (no MLX).
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct RmsNormRows {
  Elt elt = Elt::kF32;
  const void* x = nullptr;         // [rows, x_row_stride]
  const void* residual = nullptr;  // [rows, residual_row_stride]; null: no fused add
  const void* weight = nullptr;    // [hidden]
  void* out = nullptr;             // [rows, hidden]
  void* residual_out = nullptr;    // [rows, hidden]; with residual only
  int64_t rows = 0;
  int64_t hidden = 0;
  int64_t x_row_stride = 0;
  int64_t residual_row_stride = 0;
  float eps = 1e-6f;
};

// Threaded across rows; AVX2/FMA when the CPU has it.
void rms_norm_rows(const RmsNormRows& a);

}  // namespace vllm_metal::cpu
