// Attention within each sequence of a packed variable-length batch, over
// contiguous q/k/v (encoders: no paged cache). Bidirectional unless
// args.causal; args.window > 0 limits keys to |i - j| < window. One simdgroup per (query row, q head): lane owns dims
// lane + 32 c, a key's score is one simd_sum, online softmax over the keys.
#include <metal_stdlib>
#include "varlen_attention_args.h"

using namespace metal;

constant constexpr uint kSimdWidth = 32;
constant constexpr uint kMaxChunks = 8;  // head_size <= 256

template <typename T>
kernel void varlen_attention(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device const int* cu_seqlens [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant VarlenAttentionArgs& args [[buffer(5)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const int row = int(tg_pos.x);
  const uint head = tg_pos.y;
  const uint d = args.head_size;
  // the sequence holding the row: largest n with cu_seqlens[n] <= row (skips empty ones)
  uint lo = 0;
  uint hi = args.num_seqs;
  while (hi - lo > 1u) {
    const uint mid = (lo + hi) / 2u;
    if (cu_seqlens[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  int key_begin = cu_seqlens[lo];
  int key_end = args.causal != 0u ? row + 1 : cu_seqlens[lo + 1u];
  if (args.window > 0u) {
    key_begin = max(key_begin, row - int(args.window) + 1);
    key_end = min(key_end, row + int(args.window));
  }
  const uint kv_head = head / (args.num_q_heads / args.num_kv_heads);

  float qv[kMaxChunks];
  float acc[kMaxChunks];
  device const T* qrow = q + (ulong(row) * args.num_q_heads + head) * d;
  for (uint c = 0; c < kMaxChunks; ++c) {
    const uint i = lane + c * kSimdWidth;
    qv[c] = i < d ? float(qrow[i]) * args.scale : 0.0f;
    acc[c] = 0.0f;
  }
  float m = -INFINITY;
  float l = 0.0f;
  for (int j = key_begin; j < key_end; ++j) {
    const ulong at = (ulong(j) * args.num_kv_heads + kv_head) * d;
    float part = 0.0f;
    for (uint c = 0; c < kMaxChunks; ++c) {
      const uint i = lane + c * kSimdWidth;
      if (i < d) {
        part += qv[c] * float(k[at + i]);
      }
    }
    const float s = simd_sum(part);
    const float m_new = max(m, s);
    const float rescale = exp(m - m_new);  // 0 on the first key
    const float p = exp(s - m_new);
    l = l * rescale + p;
    m = m_new;
    for (uint c = 0; c < kMaxChunks; ++c) {
      const uint i = lane + c * kSimdWidth;
      if (i < d) {
        acc[c] = acc[c] * rescale + p * float(v[at + i]);
      }
    }
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  device T* orow = out + (ulong(row) * args.num_q_heads + head) * d;
  for (uint c = 0; c < kMaxChunks; ++c) {
    const uint i = lane + c * kSimdWidth;
    if (i < d) {
      orow[i] = T(acc[c] * inv);
    }
  }
}

#define instantiate_varlen_attention(tname, T)                                             \
  template [[host_name("varlen_attention_" #tname)]] kernel decltype(varlen_attention<T>) \
      varlen_attention<T>;

instantiate_varlen_attention(float32, float)
instantiate_varlen_attention(float16, half)
instantiate_varlen_attention(bfloat16, bfloat)
