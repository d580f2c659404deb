// y = x @ W^T with W in GGUF block form, on the CPU (no MLX).
//
// Decode rows (m <= kGgufMatvecMaxRows) take the matrix-vector path: each
// weight row is decoded once, in cache, and dotted with every x row. Larger m
// takes the tiled path: a tile of weight rows is decoded to float32 once and
// multiplied with all x rows by a register-blocked micro-kernel. Threaded over
// weight rows; AVX2/FMA or NEON, scalar fallback.
#pragma once

#include <cstdint>

#include "cpu/vec.h"
#include "runtime/gguf_types.h"

namespace vllm_metal::cpu {

constexpr int64_t kGgufMatvecMaxRows = 4;

struct GgufMatmul {
  gguf::GGMLType type = gguf::GGMLType::kF32;
  const void* w = nullptr;  // [n, row_bytes(type, k)]
  int64_t n = 0;            // output features (weight rows)
  int64_t k = 0;            // input features, a multiple of the block size
  Elt elt = Elt::kF32;      // of x and y
  const void* x = nullptr;  // [m, k]
  int64_t m = 0;
  void* y = nullptr;        // [m, n]
};

void gguf_matmul(const GgufMatmul& a);

}  // namespace vllm_metal::cpu
