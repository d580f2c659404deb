// Arguments of the cache-write kernels (reshape_and_cache), shared by the host and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct CacheWriteArgs {
  int64_t src_token_stride;  // element strides of src [T, H, D]
  int64_t src_head_stride;
  int64_t src_dim_stride;
  int64_t num_slots;  // num_blocks * block_size; slots outside [0, num_slots) are skipped
  uint32_t num_heads;
  uint32_t head_size;
};

struct CacheCopyArgs {
  uint64_t num_elements;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(CacheWriteArgs) == 40, "layout must match the shader");
static_assert(offsetof(CacheWriteArgs, num_heads) == 32, "layout must match the shader");
static_assert(sizeof(CacheCopyArgs) == 8, "layout must match the shader");
#endif
