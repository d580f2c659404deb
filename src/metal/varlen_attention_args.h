// Arguments of the varlen_attention kernel, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct VarlenAttentionArgs {
  uint32_t num_tokens;
  uint32_t num_seqs;
  uint32_t num_q_heads;
  uint32_t num_kv_heads;  // divides num_q_heads
  uint32_t head_size;     // <= 256
  uint32_t causal;        // 1: row i of a sequence sees keys <= i; 0: the whole sequence
  float scale;
  uint32_t window;  // > 0: row i sees keys j with |i - j| < window (sliding layers)
};

#ifndef __METAL_VERSION__
static_assert(sizeof(VarlenAttentionArgs) == 32, "VarlenAttentionArgs layout must match the shader");
static_assert(offsetof(VarlenAttentionArgs, scale) == 24,
              "VarlenAttentionArgs layout must match the shader");
#endif
