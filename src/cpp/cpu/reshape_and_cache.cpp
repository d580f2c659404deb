#include "cpu/reshape_and_cache.h"

#include <algorithm>
#include <cstring>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

int64_t find_out_of_range_slot(const int64_t* slot_mapping, int64_t num_tokens,
                               int64_t num_slots) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (slot_mapping[t] >= num_slots) return t;
  }
  return -1;
}

namespace {

// Copies one token's [H, D] rows into a dense cache row.
void copy_token(const char* src, const int64_t* strides, char* dst, int64_t heads, int64_t dim,
                int64_t itemsize) {
  const int64_t row_bytes = dim * itemsize;
  if (strides[2] == 1 && strides[1] == dim) {
    std::memcpy(dst, src, heads * row_bytes);
  } else if (strides[2] == 1) {
    for (int64_t h = 0; h < heads; ++h) {
      std::memcpy(dst + h * row_bytes, src + strides[1] * itemsize * h, row_bytes);
    }
  } else {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        std::memcpy(dst + (h * dim + d) * itemsize,
                    src + (strides[1] * h + strides[2] * d) * itemsize, itemsize);
      }
    }
  }
}

}  // namespace

void scatter_into_cache(const CacheScatter& a) {
  const int64_t row_bytes = a.num_heads * a.head_size * a.itemsize;
  auto* key = static_cast<const char*>(a.key);
  auto* value = static_cast<const char*>(a.value);
  auto* kc = static_cast<char*>(a.key_cache);
  auto* vc = static_cast<char*>(a.value_cache);
  // a fan-out costs ~6 us: only split copies of a megabyte or more
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, row_bytes));
  parallel_for(a.num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = a.slot_mapping[t];
      if (slot < 0 || slot >= a.num_slots) continue;
      copy_token(key + a.key_strides[0] * a.itemsize * t, a.key_strides, kc + slot * row_bytes,
                 a.num_heads, a.head_size, a.itemsize);
      if (value) {
        copy_token(value + a.value_strides[0] * a.itemsize * t, a.value_strides,
                   vc + slot * row_bytes, a.num_heads, a.head_size, a.itemsize);
      }
    }
  });
}

}  // namespace vllm_metal::cpu
