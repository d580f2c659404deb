// Arguments of the gelu kernel, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct GeluArgs {
  uint64_t count;        // elements
  uint32_t approximate;  // 0: erf GELU; 1: tanh approximation
  uint32_t pad_;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(GeluArgs) == 16, "GeluArgs layout must match the shader");
static_assert(offsetof(GeluArgs, approximate) == 8, "GeluArgs layout must match the shader");
#endif
