// Arguments of the layer_norm kernel, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct LayerNormArgs {
  uint32_t hidden;        // elements per row (rows are dense)
  uint32_t residual;      // 1: h = x + residual (buffer 1); 0: h = x (buffer 1 unused)
  float eps;
  uint32_t pad_;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(LayerNormArgs) == 16, "LayerNormArgs layout must match the shader");
static_assert(offsetof(LayerNormArgs, eps) == 8, "LayerNormArgs layout must match the shader");
#endif
