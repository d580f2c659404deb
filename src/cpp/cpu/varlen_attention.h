// CPU kernel of varlen_attention (attention within each sequence of a packed
// batch over contiguous q/k/v, bidirectional or causal) on raw buffers (no MLX).
// Equations: ops/varlen_attention.h.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct VarlenAttentionParams {
  Elt elt = Elt::kF32;
  const void* q = nullptr;  // [T, Hq, D] row-major
  const void* k = nullptr;  // [T, Hkv, D]
  const void* v = nullptr;  // [T, Hkv, D]
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], validated
  void* out = nullptr;                  // [T, Hq, D]
  int64_t num_seqs = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_size = 0;
  float scale = 1.0f;
  bool causal = false;
  int64_t window = 0;  // > 0: row i sees keys j with |i - j| < window
};

// Online softmax (no score matrix), threaded over (sequence, kv head, query
// tile); a tile's query rows and the kv head's q heads share each key and
// value row as it is read.
void varlen_attention(const VarlenAttentionParams& p);

}  // namespace vllm_metal::cpu
