// Writes new tokens' keys (or values) into a paged KV cache, one cache per op:
//   cache[slot / B, slot % B, h, d] = src[t, h, d], slot = slot_mapping[t]
// The cache is [num_blocks, block_size, heads, head_size] row-major, so a slot
// is simply a row of heads * head_size elements. Negative slots are padding
// and skipped; the host validates the range, the kernel never writes outside.
#include <metal_stdlib>
#include "reshape_and_cache_args.h"

using namespace metal;

template <typename T>
kernel void cache_write(
    device const T* src [[buffer(0)]],
    device const int64_t* slot_mapping [[buffer(1)]],
    device T* cache [[buffer(2)]],
    constant CacheWriteArgs& args [[buffer(3)]],
    uint token [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]]) {
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= args.num_slots) {
    return;  // uniform across the threadgroup: no barrier follows
  }
  const uint row = args.num_heads * args.head_size;
  device T* dst = cache + slot * int64_t(row);
  device const T* s = src + int64_t(token) * args.src_token_stride;
  for (uint e = tid; e < row; e += ntg) {
    const uint h = e / args.head_size;
    const uint d = e - h * args.head_size;
    dst[e] = s[h * args.src_head_stride + d * args.src_dim_stride];
  }
}

// Copies a cache that could not be updated in place (another array still
// holds the old contents), so the update stays a pure function.
template <typename T>
kernel void cache_copy(
    device const T* src [[buffer(0)]],
    device T* dst [[buffer(1)]],
    constant CacheCopyArgs& args [[buffer(2)]],
    uint group [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]]) {
  const uint64_t i = uint64_t(group) * ntg + tid;
  if (i < args.num_elements) {
    dst[i] = src[i];
  }
}

#define instantiate_reshape_and_cache(tname, T)                                 \
  template [[host_name("cache_write_" #tname)]] kernel decltype(cache_write<T>) \
      cache_write<T>;                                                           \
  template [[host_name("cache_copy_" #tname)]] kernel decltype(cache_copy<T>) \
      cache_copy<T>;

instantiate_reshape_and_cache(float32, float)
instantiate_reshape_and_cache(float16, half)
instantiate_reshape_and_cache(bfloat16, bfloat)
