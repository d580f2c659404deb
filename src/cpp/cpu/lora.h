// CPU kernel of lora_apply (per-row LoRA delta on a linear's output) on raw
// buffers (no MLX). Equations: ops/lora.h.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct LoraApplyRows {
  Elt elt = Elt::kF32;
  const void* y = nullptr;       // [T, out]
  const void* x = nullptr;       // [T, in]
  const void* a = nullptr;       // [S, R, in]
  const void* b = nullptr;       // [S, out, R]
  const float* scale = nullptr;  // [S]
  const int32_t* row_slot = nullptr;  // [T], -1 = copy y
  void* out = nullptr;           // [T, out]; may be y itself (in place)
  int64_t rows = 0;
  int64_t in_dim = 0;
  int64_t out_dim = 0;
  int64_t rank = 0;
};

// Rows are taken in slot order and split into a few parts, one pool job; a part converts
// each slot its rows use to float32 once (B transposed to [R, out]), then per row:
// h = scale * A x (R dot products), y += B h as R contiguous axpys. The summation order
// of an output is fixed: r = 0, 1, ...
void lora_apply_rows(const LoraApplyRows& a);

}  // namespace vllm_metal::cpu
