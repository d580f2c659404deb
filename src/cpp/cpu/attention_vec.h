// Inner loops of the attention kernels, one variant per ISA, chosen once.
//
// Each call covers one key or value row against a group of G query heads, so
// the call cost is amortized over G * D multiply-adds.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

template <Elt E>
struct AttentionVecOps {
  using S = typename EltTraits<E>::Storage;
  // scores[g] = dot(q + g * d, k) for g < groups (q is float32, k is E)
  void (*dot_groups)(const float* q, const S* k, float* scores, int groups, int d);
  // acc[g * d + i] = acc[g * d + i] * rescale[g] + p[g] * v[i]
  void (*update_groups)(float* acc, const float* rescale, const float* p, const S* v,
                        int groups, int d);
};

// The fastest variant this CPU supports for rows of `head_size` elements.
template <Elt E>
AttentionVecOps<E> attention_vec_ops(int head_size);

}  // namespace vllm_metal::cpu
