// Arguments of the rms_norm kernels, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstdint>
#endif

struct RmsNormArgs {
  int64_t x_row_stride;         // elements between rows of x
  int64_t residual_row_stride;  // elements between rows of residual (fused add only)
  int64_t out_row_stride;       // elements between rows of out and residual_out
  uint32_t hidden;              // elements per row
  float eps;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(RmsNormArgs) == 32, "RmsNormArgs layout must match the shader");
static_assert(offsetof(RmsNormArgs, hidden) == 24, "RmsNormArgs layout must match the shader");
#endif
