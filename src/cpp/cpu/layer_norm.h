// CPU kernel of layer_norm on raw row-major buffers (no MLX): per row,
//   h = x (+ residual, rounded to elt), y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias
// float32 arithmetic, mean and variance in two passes over the row (it stays in L1).
// Threaded across rows, AVX2 when the CPU has it: MLX's CPU LayerNorm and the residual add
// before it run on one thread.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct LayerNormRows {
  Elt elt = Elt::kF32;
  const void* x = nullptr;         // [rows, hidden]
  const void* residual = nullptr;  // [rows, hidden], or null: no add
  const void* weight = nullptr;    // [hidden]
  const void* bias = nullptr;      // [hidden]
  void* out = nullptr;             // [rows, hidden]
  int64_t rows = 0;
  int64_t hidden = 0;
  float eps = 1e-5f;
};

void layer_norm_rows(const LayerNormRows& a);

}  // namespace vllm_metal::cpu
