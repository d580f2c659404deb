// Arguments of the mrope kernels, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct MropeArgs {
  uint32_t num_tokens;   // T; positions are [3, T]
  uint32_t num_heads;
  uint32_t head_size;
  uint32_t rotary_half;  // rotary_dim / 2 = section0 + section1 + section2
  uint32_t section0;     // pairs driven by the temporal position
  uint32_t section1;     // ... by the height position
  uint32_t section2;     // ... by the width position
  uint32_t interleaved;  // 1: Qwen3-VL layout (t, h, w, t, h, w, ...); 0: Qwen2-VL blocks
};

#ifndef __METAL_VERSION__
static_assert(sizeof(MropeArgs) == 32, "MropeArgs layout must match the shader");
static_assert(offsetof(MropeArgs, interleaved) == 28, "MropeArgs layout must match the shader");
#endif
