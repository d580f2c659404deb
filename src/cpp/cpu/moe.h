// CPU kernel of fused_moe (routing + grouped SwiGLU experts) on raw buffers
// (no MLX). Equations: ops/moe.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

// gpt-oss's variations (ops/moe.h): routing weights = softmax over the k chosen
// logits; per-expert biases (float32, nullptr = none) added to the gate/up/down
// outputs; the clamped SwiGLU (up + 1) * g * sigmoid(alpha g), g = min(gate, limit),
// up clamped to [-limit, limit].
struct MoeExtras {
  bool topk_softmax = false;
  bool oai_act = false;
  const float* b_gate = nullptr;  // [E, I]
  const float* b_up = nullptr;    // [E, I]
  const float* b_down = nullptr;  // [E, H]
};

// gpt-oss's activation constants (transformers' GptOssExperts)
constexpr float kOaiAlpha = 1.702f;
constexpr float kOaiLimit = 7.0f;

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
  MoeExtras extras;  // gpt-oss: top-k softmax, biases, clamped SwiGLU
};

// Routing per token, then per active expert its slots' rows through gguf_matmul's
// dense (F32 / F16 / BF16) kernels (cpu/moe_gguf.h): each expert's weights read once.
void fused_moe_rows(const MoeRows& a);

// The routing alone (what the Metal moe_route kernel computes), for one token.
void moe_route_token(const float* logits, int64_t num_experts, int64_t top_k, bool sigmoid,
                     bool renormalize, int32_t* ids, float* weights, bool topk_softmax = false);

// act = silu(g) * u, or gpt-oss's clamped SwiGLU when oai
inline float moe_act(float g, float u, bool oai) {
  if (!oai) return g / (1.0f + std::exp(-g)) * u;
  g = std::min(g, kOaiLimit);
  u = std::max(std::min(u, kOaiLimit), -kOaiLimit);
  return (u + 1.0f) * g / (1.0f + std::exp(-kOaiAlpha * g));
}

}  // namespace vllm_metal::cpu
