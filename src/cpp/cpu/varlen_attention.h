// CPU kernel of varlen_attention (attention within each sequence of a packed
// batch over contiguous q/k/v, bidirectional or causal) on raw buffers (no MLX).
// Equations: ops/varlen_attention.h.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct VarlenAttentionParams {
  Elt elt = Elt::kF32;
  const void* q = nullptr;  // [T, Hq, D]: each token's heads dense, tokens q_stride apart
  const void* k = nullptr;  // [T, Hkv, D], tokens k_stride apart
  const void* v = nullptr;  // [T, Hkv, D], tokens v_stride apart
  // Elements from one token to the next; 0: dense (Hq * D, Hkv * D). Strided rows let q, k
  // and v be slices of one fused projection [T, 3, H, D] without a copy each.
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1], validated
  void* out = nullptr;                  // [T, Hq, D], dense
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
