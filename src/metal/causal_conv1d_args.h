// Arguments of the causal_conv1d kernels, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct CausalConv1dArgs {
  uint32_t num_seqs;
  uint32_t channels;
  uint32_t width;     // kernel size K, 2..8; the state keeps K - 1 inputs
  uint32_t has_bias;  // 0: no bias (buffer 1 is bound to x as a placeholder)
  uint32_t silu;      // 1: out = silu(conv)
  uint32_t pad_;
};

struct ConvStateCopyArgs {
  uint64_t count;  // elements
};

#ifndef __METAL_VERSION__
static_assert(sizeof(CausalConv1dArgs) == 24, "CausalConv1dArgs layout must match the shader");
static_assert(offsetof(CausalConv1dArgs, silu) == 16, "CausalConv1dArgs layout must match the shader");
static_assert(sizeof(ConvStateCopyArgs) == 8, "ConvStateCopyArgs layout must match the shader");
#endif
