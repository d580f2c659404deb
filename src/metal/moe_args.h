// Arguments of the fused mixture-of-experts kernels, shared by the host (C++)
// and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct MoeArgs {
  uint32_t num_tokens;   // T
  uint32_t hidden;       // H
  uint32_t num_experts;  // E
  uint32_t inter;        // I, the expert MLP width
  uint32_t top_k;        // k
  uint32_t renormalize;  // 1: the k routing weights are divided by their sum
  uint32_t sigmoid;      // 1: scores = sigmoid(logits), else softmax over E
  uint32_t flags;        // kMoe* bits (gpt-oss's variations, ops/moe.h)
};

enum MoeFlags : uint32_t {
  kMoeTopkSoftmax = 1u,  // weights = softmax over the k chosen logits
  kMoeOaiAct = 2u,       // gpt-oss's clamped SwiGLU: (up + 1) * g * sigmoid(1.702 g)
  kMoeBias = 4u,         // per-expert float32 gate/up/down biases
};

#ifdef __METAL_VERSION__
// act of one (gate, up) pair after the biases: silu(g) * u, or gpt-oss's clamped
// SwiGLU (g = min(g, 7), u = clamp(u, -7, 7), (u + 1) * g * sigmoid(1.702 g))
inline float moe_activation(float g, float u, uint32_t flags) {
  if ((flags & kMoeOaiAct) == 0u) {
    return g / (1.0f + metal::exp(-g)) * u;
  }
  g = metal::min(g, 7.0f);
  u = metal::max(metal::min(u, 7.0f), -7.0f);
  return (u + 1.0f) * g / (1.0f + metal::exp(-1.702f * g));
}
#endif

#ifndef __METAL_VERSION__
static_assert(sizeof(MoeArgs) == 32, "MoeArgs layout must match the shader");
static_assert(offsetof(MoeArgs, sigmoid) == 24, "MoeArgs layout must match the shader");
#endif

// fused_moe_gguf: expert weights in GGUF block form, [E * rows] rows of `*_row_bytes`.
struct MoeGgufArgs {
  MoeArgs moe;
  uint32_t gate_type;  // GGML type ids
  uint32_t up_type;
  uint32_t down_type;
  uint32_t piece;      // weights per decode: 16, or 8 (gguf_matvec_core.h)
  uint64_t gate_row_bytes;
  uint64_t up_row_bytes;
  uint64_t down_row_bytes;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(MoeGgufArgs) == 72, "MoeGgufArgs layout must match the shader");
static_assert(offsetof(MoeGgufArgs, gate_row_bytes) == 48, "MoeGgufArgs layout must match the shader");
#endif
