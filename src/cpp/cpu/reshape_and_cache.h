// CPU kernel of reshape_and_cache on raw buffers (no MLX).
#pragma once

#include <cstdint>

namespace vllm_metal::cpu {

struct CacheScatter {
  const void* key = nullptr;    // [T, H, D] with the strides below (elements)
  const void* value = nullptr;  // [T, H, D]; null: write the key cache only
  const int64_t* slot_mapping = nullptr;  // [T]
  void* key_cache = nullptr;    // [num_slots, H, D] row-major
  void* value_cache = nullptr;
  int64_t key_strides[3] = {0, 0, 0};
  int64_t value_strides[3] = {0, 0, 0};
  int64_t num_tokens = 0;
  int64_t num_heads = 0;
  int64_t head_size = 0;
  int64_t num_slots = 0;
  int64_t itemsize = 2;  // 2 or 4 bytes
};

// Index of the first token whose slot is >= num_slots, or -1.
int64_t find_out_of_range_slot(const int64_t* slot_mapping, int64_t num_tokens,
                               int64_t num_slots);

// Skips negative slots; the caller has rejected slots >= num_slots.
void scatter_into_cache(const CacheScatter& a);

}  // namespace vllm_metal::cpu
