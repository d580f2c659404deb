// Arguments of the reshape_and_cache kernels, shared by the host and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct ReshapeAndCacheArgs {
  int64_t key_token_stride;  // element strides of key [T, H, D]
  int64_t key_head_stride;
  int64_t key_dim_stride;
  int64_t value_token_stride;  // element strides of value [T, H, D]
  int64_t value_head_stride;
  int64_t value_dim_stride;
  int64_t num_slots;  // num_blocks * block_size; slots outside [0, num_slots) are skipped
  uint32_t num_heads;
  uint32_t head_size;
};

struct CacheCopyArgs {
  uint64_t num_elements;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(ReshapeAndCacheArgs) == 64, "layout must match the shader");
static_assert(offsetof(ReshapeAndCacheArgs, num_heads) == 56, "layout must match the shader");
static_assert(sizeof(CacheCopyArgs) == 8, "layout must match the shader");
#endif
