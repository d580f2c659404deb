// Arguments of the gated delta rule kernels, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct GatedDeltaArgs {
  uint32_t num_seqs;
  uint32_t hk;       // key heads (q and k)
  uint32_t hv;       // value heads, a multiple of hk
  uint32_t dk;       // key head size, <= 256
  uint32_t dv;       // value head size
  float eps;         // added to sum(x^2) of the L2 norms
  float q_scale;     // 1 / sqrt(dk)
  uint32_t pad_;
};

struct StateCopyArgs {
  uint64_t count;  // elements
};

#ifndef __METAL_VERSION__
static_assert(sizeof(GatedDeltaArgs) == 32, "GatedDeltaArgs layout must match the shader");
static_assert(offsetof(GatedDeltaArgs, eps) == 20, "GatedDeltaArgs layout must match the shader");
static_assert(offsetof(GatedDeltaArgs, q_scale) == 24, "GatedDeltaArgs layout must match the shader");
static_assert(sizeof(StateCopyArgs) == 8, "StateCopyArgs layout must match the shader");
#endif
