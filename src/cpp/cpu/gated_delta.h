// CPU kernels of the gated delta rule (Qwen3-Next / Qwen3.5 linear attention)
// on raw buffers (no MLX). Equations: ops/gated_delta.h.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct GatedDeltaRows {
  Elt elt = Elt::kF32;
  const void* q = nullptr;          // [T, hk, dk], row-contiguous, elt
  const void* k = nullptr;          // [T, hk, dk]
  const void* v = nullptr;          // [T, hv, dv]
  const float* a = nullptr;         // [T, hv]
  const float* b = nullptr;         // [T, hv]
  const float* a_log = nullptr;     // [hv]
  const float* dt_bias = nullptr;   // [hv]
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  const int32_t* slots = nullptr;       // [num_seqs]
  const int32_t* has_initial_state = nullptr;  // [num_seqs]
  float* state = nullptr;           // [num_slots, hv, dv, dk]; the sequences' slots are updated
  void* y = nullptr;                // [T, hv, dv], elt
  int64_t num_seqs = 0;
  int64_t tokens = 0;
  int64_t hk = 0;
  int64_t hv = 0;
  int64_t dk = 0;
  int64_t dv = 0;
  float eps = 1e-6f;
  // 0: token-by-token recurrence; else the chunked (WY) form with this many
  // tokens per chunk. Both give the same result up to float32 rounding.
  int64_t chunk_size = 0;
};

void gated_delta_rows(const GatedDeltaRows& a);

// Helpers shared with the benchmarks and tests: float32 dot and y = a*y + b*x
// (AVX2/FMA when the CPU has it, NEON on arm64).
float dot_f32(const float* a, const float* b, int64_t n);
void axpby_f32(float* y, float a, float b, const float* x, int64_t n);

}  // namespace vllm_metal::cpu
