// Attention within each sequence of a packed variable-length batch, over
// contiguous q/k/v (encoders: no paged cache). Bidirectional unless
// args.causal; args.window > 0 limits keys to |i - j| < window. Two kernels
// (plan_varlen_attention picks one by head size):
// - varlen_attention_tiled_*_d{D}: 8 query rows of one head share each key and
//   value load; scores and P V on 8x8 simdgroup matrices.
// - varlen_attention_*: any head size; one simdgroup per (query row, q head), lane
//   owns dims lane + 32 c, a key's score is one simd_sum, online softmax over the keys.
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

constant constexpr uint kTile = 8;  // the tiled kernel: query rows of a simdgroup, keys a step

// One simdgroup: kTile query rows of one q head of one sequence against the keys they
// see, kTile keys a step. S = Q K^T and O = diag(rescale) O + P V run on 8x8 simdgroup
// matrices staged in threadgroup memory as float32; the online softmax (row max, row sum,
// the rescale as a diagonal matrix) is kept by lanes 0-7. Each key and value row is read
// once per tile of query rows, not once per row. Grid: (tiles of the longest sequence,
// q heads, sequences); tiles past a sequence's end return at once.
template <typename T, uint D>
kernel void varlen_attention_tiled(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device const int* cu_seqlens [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant VarlenAttentionArgs& args [[buffer(5)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  static_assert(D % kTile == 0 && D <= kSimdWidth * kMaxChunks, "head size: 8 .. 256, a multiple of 8");
  threadgroup float q_tile[kTile * D];   // scaled queries; finally the output
  threadgroup float kv_tile[kTile * D];  // the step's keys, then its values
  threadgroup float s_tile[kTile * kTile];
  threadgroup float diag[kTile * kTile];
  threadgroup float row_max[kTile];
  threadgroup float row_sum[kTile];

  const uint seq = tg_pos.z;
  const uint head = tg_pos.y;
  const int start = cu_seqlens[seq];
  const int len = cu_seqlens[seq + 1u] - start;
  const int r0 = int(tg_pos.x * kTile);
  if (r0 >= len) {
    return;  // the grid covers the longest sequence; this one is shorter
  }
  const int rows = min(int(kTile), len - r0);
  const uint kv_head = head / (args.num_q_heads / args.num_kv_heads);
  const int window = int(args.window);
  // keys (sequence positions) that some row of the tile sees: [key_lo, key_hi)
  int key_lo = 0;
  int key_hi = args.causal != 0u ? r0 + rows : len;
  if (window > 0) {
    key_lo = max(0, r0 - window + 1);
    key_hi = min(key_hi, r0 + rows - 1 + window);
  }

  for (uint i = lane; i < kTile * D; i += kSimdWidth) {
    const int r = int(i / D);
    q_tile[i] = r < rows
        ? float(q[(ulong(start + r0 + r) * args.num_q_heads + head) * D + i % D]) * args.scale
        : 0.0f;
  }
  for (uint i = lane; i < kTile * kTile; i += kSimdWidth) {
    diag[i] = 0.0f;
  }
  if (lane < kTile) {
    row_max[lane] = -INFINITY;
    row_sum[lane] = 0.0f;
  }
  simdgroup_float8x8 o[D / kTile];
  for (uint b = 0; b < D / kTile; ++b) {
    o[b] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int j0 = key_lo; j0 < key_hi; j0 += int(kTile)) {
    // keys j0 .. j0 + 7; zero rows past the tile's last key
    for (uint i = lane; i < kTile * D; i += kSimdWidth) {
      const int j = j0 + int(i / D);
      kv_tile[i] = j < key_hi ? float(k[(ulong(start + j) * args.num_kv_heads + kv_head) * D + i % D]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint b = 0; b < D / kTile; ++b) {
      simdgroup_float8x8 qm;
      simdgroup_float8x8 kt;
      simdgroup_load(qm, q_tile + b * kTile, D);
      simdgroup_load(kt, kv_tile + b * kTile, D, ulong2(0, 0), true);  // K^T
      simdgroup_multiply_accumulate(s, qm, kt, s);
    }
    simdgroup_store(s, s_tile, kTile);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (lane < kTile) {
      const int r = int(lane);
      const int pos = r0 + r;
      const float m_old = row_max[r];
      float m_new = m_old;
      for (uint c = 0; c < kTile; ++c) {
        const int j = j0 + int(c);
        const bool visible = r < rows && j < key_hi && (args.causal == 0u || j <= pos) &&
                             (window <= 0 || abs(pos - j) < window);
        const float sc = s_tile[r * kTile + c];
        s_tile[r * kTile + c] = visible ? sc : -INFINITY;
        m_new = visible ? max(m_new, sc) : m_new;
      }
      const float resc = m_new == -INFINITY ? 1.0f : exp(m_old - m_new);
      float sum = row_sum[r] * resc;
      for (uint c = 0; c < kTile; ++c) {
        const float sc = s_tile[r * kTile + c];
        const float p = sc == -INFINITY ? 0.0f : exp(sc - m_new);
        s_tile[r * kTile + c] = p;
        sum += p;
      }
      row_max[r] = m_new;
      row_sum[r] = sum;
      diag[r * kTile + r] = resc;
    }
    for (uint i = lane; i < kTile * D; i += kSimdWidth) {
      const int j = j0 + int(i / D);
      kv_tile[i] = j < key_hi ? float(v[(ulong(start + j) * args.num_kv_heads + kv_head) * D + i % D]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // and P, diag of lanes 0-7
    simdgroup_float8x8 dm;
    simdgroup_float8x8 pm;
    simdgroup_load(dm, diag, kTile);
    simdgroup_load(pm, s_tile, kTile);
    for (uint b = 0; b < D / kTile; ++b) {
      simdgroup_float8x8 vm;
      simdgroup_load(vm, kv_tile + b * kTile, D);
      simdgroup_multiply(o[b], dm, o[b]);
      simdgroup_multiply_accumulate(o[b], pm, vm, o[b]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // kv_tile, s_tile and diag are rewritten next
  }

  if (lane < kTile) {
    diag[lane * kTile + lane] = row_sum[lane] > 0.0f ? 1.0f / row_sum[lane] : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 dm;
  simdgroup_load(dm, diag, kTile);
  for (uint b = 0; b < D / kTile; ++b) {
    simdgroup_multiply(o[b], dm, o[b]);
    simdgroup_store(o[b], q_tile + b * kTile, D);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = lane; i < uint(rows) * D; i += kSimdWidth) {
    out[(ulong(start + r0) + i / D) * args.num_q_heads * D + head * D + i % D] = T(q_tile[i]);
  }
}

#define instantiate_varlen_attention(tname, T)                                             \
  template [[host_name("varlen_attention_" #tname)]] kernel decltype(varlen_attention<T>) \
      varlen_attention<T>;

instantiate_varlen_attention(float32, float)
instantiate_varlen_attention(float16, half)
instantiate_varlen_attention(bfloat16, bfloat)

// Head sizes of the BERT family (32: MiniLM, 64: BERT-base, XLM-R, BGE), 128 and Gemma 3's
// 256 (tiled_head_sizes() in src/cpp/ops/varlen_attention.cpp); others take the simd kernel.
#define instantiate_varlen_attention_tiled(tname, T, D)                                    \
  template [[host_name("varlen_attention_tiled_" #tname "_d" #D)]] kernel decltype(       \
      varlen_attention_tiled<T, D>) varlen_attention_tiled<T, D>;
#define instantiate_varlen_attention_tiled_heads(tname, T) \
  instantiate_varlen_attention_tiled(tname, T, 32)          \
  instantiate_varlen_attention_tiled(tname, T, 64)          \
  instantiate_varlen_attention_tiled(tname, T, 128)         \
  instantiate_varlen_attention_tiled(tname, T, 256)

instantiate_varlen_attention_tiled_heads(float32, float)
instantiate_varlen_attention_tiled_heads(float16, half)
instantiate_varlen_attention_tiled_heads(bfloat16, bfloat)
