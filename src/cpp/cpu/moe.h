// CPU kernel of fused_moe (routing + grouped SwiGLU experts) on raw buffers
// (no MLX). Equations: ops/moe.h.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct MoeRows {
  Elt elt = Elt::kF32;          // hidden / out
  Elt w_elt = Elt::kF32;        // expert weights
  const void* x = nullptr;      // [T, H]
  const float* logits = nullptr;  // [T, E]
  const void* w_gate = nullptr;   // [E, I, H]
  const void* w_up = nullptr;     // [E, I, H]
  const void* w_down = nullptr;   // [E, H, I]
  void* out = nullptr;            // [T, H]
  int32_t* ids = nullptr;         // [T, k] out: the chosen experts
  float* weights = nullptr;       // [T, k] out: their routing weights
  int64_t num_tokens = 0;
  int64_t hidden = 0;
  int64_t num_experts = 0;
  int64_t inter = 0;
  int64_t top_k = 1;
  bool renormalize = false;
  bool sigmoid = false;
};

// Routing per token, then per active expert its slots' rows through gguf_matmul's
// dense (F32 / F16 / BF16) kernels (cpu/moe_gguf.h): each expert's weights read once.
void fused_moe_rows(const MoeRows& a);

// The routing alone (what the Metal moe_route kernel computes), for one token.
void moe_route_token(const float* logits, int64_t num_experts, int64_t top_k, bool sigmoid,
                     bool renormalize, int32_t* ids, float* weights);

}  // namespace vllm_metal::cpu
