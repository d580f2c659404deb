// Arguments of the rope kernels, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct RopeArgs {
  int64_t x_token_stride;    // elements between tokens of x
  int64_t x_head_stride;     // elements between heads of x
  int64_t x_dim_stride;      // elements between dimensions of x (1 unless a strided view)
  int64_t out_token_stride;  // elements between tokens of out (num_heads * head_size)
  uint32_t num_heads;
  uint32_t head_size;
  uint32_t rotary_half;      // rotary_dim / 2: pairs rotated per head
  float mscale;              // multiplies cos and sin (yarn attention factor)
};

#ifndef __METAL_VERSION__
static_assert(sizeof(RopeArgs) == 48, "RopeArgs layout must match the shader");
static_assert(offsetof(RopeArgs, out_token_stride) == 24, "RopeArgs layout must match the shader");
static_assert(offsetof(RopeArgs, num_heads) == 32, "RopeArgs layout must match the shader");
static_assert(offsetof(RopeArgs, rotary_half) == 40, "RopeArgs layout must match the shader");
static_assert(offsetof(RopeArgs, mscale) == 44, "RopeArgs layout must match the shader");
#endif
