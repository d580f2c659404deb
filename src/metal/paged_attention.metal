// Paged attention over a packed batch: decode (one query per sequence, online
// softmax, optional split-KV partitions + reduce) and tiled prefill with
// simdgroup matrices. Conventions in src/cpp/ops/paged_attention.h; buffer
// slots in plan_paged_attention. Block ids outside the cache are skipped, so
// bad metadata never reads outside the buffers.
#include <metal_stdlib>
#include "paged_attention_args.h"
#include "paged_attention_split.h"

using namespace metal;

constant constexpr uint kSimdWidth = 32;
constant constexpr uint kMaxGroup = 8;          // query heads per decode threadgroup
constant constexpr uint kDecodeSimdgroups = 4;  // 128 threads
constant constexpr uint kTile = 8;              // prefill query rows / keys per chunk
constant constexpr uint kMaxStagedDims = 256;   // prefill: K/V dims in threadgroup memory at once

// Cache row of position j of a sequence, or -1 when its block id is invalid.
inline int64_t cache_row(device const int* table, int j, constant PagedAttentionArgs& args) {
  const int block = table[j / int(args.block_size)];
  if (block < 0 || int64_t(block) >= args.num_blocks) {
    return -1;
  }
  return int64_t(block) * args.block_size + j % int(args.block_size);
}

inline float soft_cap(float s, float cap) {
  return cap > 0.0f ? cap * precise::tanh(s / cap) : s;
}

template <typename T, uint D>
kernel void paged_attention_decode(
    device const T* q [[buffer(0)]],
    device const T* key_cache [[buffer(1)]],
    device const T* value_cache [[buffer(2)]],
    device const int* block_tables [[buffer(3)]],
    device const int* seq_lens [[buffer(4)]],
    device const int* cu_seqlens_q [[buffer(5)]],
    device const float* sinks [[buffer(6)]],
    device T* out [[buffer(7)]],
    device float* partial_out [[buffer(8)]],
    device float* partial_max [[buffer(9)]],
    device float* partial_sum [[buffer(10)]],
    constant PagedAttentionArgs& args [[buffer(11)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint C = (D + kSimdWidth - 1) / kSimdWidth;  // lane owns dims lane + 32 * c
  threadgroup float merge_acc[kMaxGroup * D];
  threadgroup float merge_max[kMaxGroup];
  threadgroup float merge_sum[kMaxGroup];

  const uint groups = args.num_q_heads / args.num_kv_heads;
  const uint slices = (groups + kMaxGroup - 1) / kMaxGroup;
  const uint kv_head = tg_pos.x / slices;
  const uint head0 = kv_head * groups + (tg_pos.x % slices) * kMaxGroup;
  const uint nheads = min(kMaxGroup, kv_head * groups + groups - head0);
  const uint part = tg_pos.z;
  int row;
  uint seq;
  int ctx;
  if (!locate_query(seq_lens, cu_seqlens_q, args, tg_pos.y, row, seq, ctx)) {
    return;  // whole threadgroup, before any barrier: a padding token
  }

  // its visible keys, cut to this partition
  int lo = first_key(ctx, args);
  int hi = ctx;
  bool direct = args.num_partitions == 1;  // write the output, not a partial
  if (args.token_rows != 0) {
    const int2 own = row_partitions(ctx, args);  // first, last
    const int p = own.x + int(part);
    if (p > own.y) {
      return;  // whole threadgroup: this row has fewer partitions than the grid
    }
    direct = own.x == own.y;
    lo = max(lo, p * int(args.partition_size));
    hi = min(hi, (p + 1) * int(args.partition_size));
  } else if (args.num_partitions > 1) {
    lo = max(lo, int(part * args.partition_size));
    hi = min(hi, int((part + 1) * args.partition_size));
  }

  float qr[kMaxGroup][C];
  float acc[kMaxGroup][C];
  float m[kMaxGroup];
  float l[kMaxGroup];
  for (uint h = 0; h < kMaxGroup; ++h) {
    // a sink is a logit whose value row is 0; counted once: partition 0, simdgroup 0
    const bool sink = args.has_sinks != 0 && part == 0 && sg == 0 && h < nheads;
    m[h] = sink ? sinks[head0 + h] : -INFINITY;
    l[h] = sink ? 1.0f : 0.0f;
    for (uint c = 0; c < C; ++c) {
      const uint d = lane + kSimdWidth * c;
      const bool live = h < nheads && d < D;
      qr[h][c] = live ? float(q[row * args.q_token_stride + (head0 + h) * args.q_head_stride + d]) * args.scale : 0.0f;
      acc[h][c] = 0.0f;
    }
  }

  device const int* table = block_tables + seq * args.max_blocks;
  const int64_t row_elems = int64_t(args.num_kv_heads) * D;
  for (int j = lo + int(sg); j < hi; j += int(kDecodeSimdgroups)) {
    const int64_t slot = cache_row(table, j, args);
    if (slot < 0) {
      continue;  // uniform within the simdgroup: all lanes share j
    }
    const int64_t base = slot * row_elems + int64_t(kv_head) * D;
    float kr[C];
    float vr[C];
    for (uint c = 0; c < C; ++c) {
      const uint d = lane + kSimdWidth * c;
      kr[c] = d < D ? float(key_cache[base + d]) : 0.0f;
      vr[c] = d < D ? float(value_cache[base + d]) : 0.0f;
    }
    for (uint h = 0; h < nheads; ++h) {
      float dot = 0.0f;
      for (uint c = 0; c < C; ++c) {
        dot += qr[h][c] * kr[c];
      }
      const float s = soft_cap(simd_sum(dot), args.softcap);
      const float m_new = max(m[h], s);
      const float r = exp(m[h] - m_new);
      const float p = exp(s - m_new);
      l[h] = l[h] * r + p;
      m[h] = m_new;
      for (uint c = 0; c < C; ++c) {
        acc[h][c] = acc[h][c] * r + p * vr[c];
      }
    }
  }

  // fold simdgroups 1..3 into simdgroup 0, one at a time through threadgroup memory
  for (uint other = 1; other < kDecodeSimdgroups; ++other) {
    if (sg == other) {
      for (uint h = 0; h < nheads; ++h) {
        if (lane == 0) {
          merge_max[h] = m[h];
          merge_sum[h] = l[h];
        }
        for (uint c = 0; c < C; ++c) {
          const uint d = lane + kSimdWidth * c;
          if (d < D) {
            merge_acc[h * D + d] = acc[h][c];
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (sg == 0) {
      for (uint h = 0; h < nheads; ++h) {
        const float m_other = merge_max[h];
        const float m_new = max(m[h], m_other);
        const float r_self = rescale_factor(m[h], m_new);
        const float r_other = rescale_factor(m_other, m_new);
        l[h] = l[h] * r_self + merge_sum[h] * r_other;
        m[h] = m_new;
        for (uint c = 0; c < C; ++c) {
          const uint d = lane + kSimdWidth * c;
          if (d < D) {
            acc[h][c] = acc[h][c] * r_self + merge_acc[h * D + d] * r_other;
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  if (sg != 0) {
    return;
  }
  for (uint h = 0; h < nheads; ++h) {
    const uint head = head0 + h;
    if (direct) {
      const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
      device T* dst = out + (int64_t(row) * args.num_q_heads + head) * D;
      for (uint c = 0; c < C; ++c) {
        const uint d = lane + kSimdWidth * c;
        if (d < D) {
          dst[d] = T(acc[h][c] * inv);
        }
      }
    } else {
      const int64_t cell = (int64_t(tg_pos.y) * args.num_q_heads + head) * args.num_partitions + part;
      if (lane == 0) {
        partial_max[cell] = m[h];
        partial_sum[cell] = l[h];
      }
      for (uint c = 0; c < C; ++c) {
        const uint d = lane + kSimdWidth * c;
        if (d < D) {
          partial_out[cell * D + d] = acc[h][c];
        }
      }
    }
  }
}

// Combines the split-KV partitions of one (decode row, head).
template <typename T, uint D>
kernel void paged_attention_reduce(
    device const T* q [[buffer(0)]],
    device const T* key_cache [[buffer(1)]],
    device const T* value_cache [[buffer(2)]],
    device const int* block_tables [[buffer(3)]],
    device const int* seq_lens [[buffer(4)]],
    device const int* cu_seqlens_q [[buffer(5)]],
    device const float* sinks [[buffer(6)]],
    device T* out [[buffer(7)]],
    device const float* partial_out [[buffer(8)]],
    device const float* partial_max [[buffer(9)]],
    device const float* partial_sum [[buffer(10)]],
    constant PagedAttentionArgs& args [[buffer(11)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint head = tg_pos.x;
  int row;
  uint seq;
  int ctx;
  if (!locate_query(seq_lens, cu_seqlens_q, args, tg_pos.y, row, seq, ctx)) {
    return;
  }
  // a row with one partition (token_rows: its own) wrote its output directly
  const uint parts = paged_row_parts(ctx, args);
  if (parts <= 1) {
    return;
  }
  const int64_t cell0 = paged_split_cell(tg_pos.y, head, args);
  const float2 scale = paged_split_scale(partial_max, partial_sum, cell0, parts);  // m, 1 / sum
  device T* dst = out + (int64_t(row) * args.num_q_heads + head) * D;
  for (uint d = lane; d < D; d += kSimdWidth) {
    dst[d] = T(paged_split_value(partial_out, partial_max, cell0, parts, D, d, scale.x) * scale.y);
  }
}

// One simdgroup: 8 query rows of one head against the visible keys, 8 keys at
// a time. S = Q K^T and O += P V run on 8x8 simdgroup matrices staged in
// threadgroup memory as float32; the online-softmax bookkeeping (row max,
// row sum, the rescale of O through a diagonal matrix) is done by lanes 0-7.
template <typename T, uint D>
kernel void paged_attention_prefill(
    device const T* q [[buffer(0)]],
    device const T* key_cache [[buffer(1)]],
    device const T* value_cache [[buffer(2)]],
    device const int* block_tables [[buffer(3)]],
    device const int* seq_lens [[buffer(4)]],
    device const int* cu_seqlens_q [[buffer(5)]],
    device const float* sinks [[buffer(6)]],
    device T* out [[buffer(7)]],
    constant PagedAttentionArgs& args [[buffer(8)]],
    uint3 tg_pos [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  // Keys and values are staged KC dims at a time: with D = 512 a whole 8-row
  // tile next to the queries would exceed the 32 KB of threadgroup memory.
  constexpr uint KC = D > kMaxStagedDims ? kMaxStagedDims : D;
  static_assert(D % KC == 0, "head size must be a multiple of the staged width");
  threadgroup float q_tile[kTile * D];    // scaled queries; finally the output
  threadgroup float kv_tile[kTile * KC];  // keys, then values: KC dims of the current chunk
  threadgroup float s_tile[kTile * kTile];
  threadgroup float diag[kTile * kTile];
  threadgroup float row_max[kTile];
  threadgroup float row_sum[kTile];

  const uint seq = args.seq_offset + tg_pos.z;
  const uint head = tg_pos.y;
  const int q_start = cu_seqlens_q[seq];
  const int q_len = cu_seqlens_q[seq + 1] - q_start;
  const int tile_start = int(tg_pos.x * kTile);
  if (tile_start >= q_len) {
    return;  // the grid covers the longest chunk; this sequence's is shorter
  }
  const int ctx = seq_lens[seq];
  const int rows = min(int(kTile), q_len - tile_start);
  const uint kv_head = head / (args.num_q_heads / args.num_kv_heads);
  const int first_pos = ctx - q_len + tile_start;
  const int last_pos = first_pos + rows - 1;
  int key_lo = args.sliding_window > 0 ? max(0, first_pos - args.sliding_window + 1) : 0;
  key_lo -= key_lo % int(kTile);
  device const int* table = block_tables + seq * args.max_blocks;
  const int64_t row_elems = int64_t(args.num_kv_heads) * D;

  for (uint i = lane; i < kTile * D; i += kSimdWidth) {
    const int r = int(i / D);
    const uint d = i % D;
    q_tile[i] = r < rows
        ? float(q[int64_t(q_start + tile_start + r) * args.q_token_stride + head * args.q_head_stride + d]) * args.scale
        : 0.0f;
  }
  for (uint i = lane; i < kTile * kTile; i += kSimdWidth) {
    diag[i] = 0.0f;
  }
  if (lane < kTile) {
    row_max[lane] = args.has_sinks != 0 ? sinks[head] : -INFINITY;
    row_sum[lane] = args.has_sinks != 0 ? 1.0f : 0.0f;
  }
  simdgroup_float8x8 o[D / kTile];
  for (uint b = 0; b < D / kTile; ++b) {
    o[b] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int j0 = key_lo; j0 <= last_pos; j0 += int(kTile)) {
    // keys j0..j0+7 (zero past the context or behind an invalid block id), KC dims at a time
    simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    for (uint d0 = 0; d0 < D; d0 += KC) {
      for (uint i = lane; i < kTile * KC; i += kSimdWidth) {
        const int j = j0 + int(i / KC);
        const int64_t slot = j < ctx ? cache_row(table, j, args) : -1;
        kv_tile[i] = slot >= 0 ? float(key_cache[slot * row_elems + int64_t(kv_head) * D + d0 + i % KC]) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint b = 0; b < KC / kTile; ++b) {
        simdgroup_float8x8 qm;
        simdgroup_float8x8 kt;
        simdgroup_load(qm, q_tile + d0 + b * kTile, D);
        simdgroup_load(kt, kv_tile + b * kTile, KC, ulong2(0, 0), true);  // K^T
        simdgroup_multiply_accumulate(s, qm, kt, s);
      }
      if (d0 + KC < D) {
        threadgroup_barrier(mem_flags::mem_threadgroup);  // kv_tile is refilled next
      }
    }
    simdgroup_store(s, s_tile, kTile);
    threadgroup_barrier(mem_flags::mem_threadgroup);

    if (lane < kTile) {
      const int r = int(lane);
      const int pos = first_pos + r;
      const float m_old = row_max[r];
      float m_new = m_old;
      for (uint k = 0; k < kTile; ++k) {
        const int j = j0 + int(k);
        const bool visible = r < rows && j <= pos && (args.sliding_window <= 0 || j > pos - args.sliding_window);
        const float sc = soft_cap(s_tile[r * kTile + k], args.softcap);
        s_tile[r * kTile + k] = visible ? sc : -INFINITY;
        m_new = visible ? max(m_new, sc) : m_new;
      }
      const float resc = m_new == -INFINITY ? 1.0f : exp(m_old - m_new);
      float sum = row_sum[r] * resc;
      for (uint k = 0; k < kTile; ++k) {
        const float sc = s_tile[r * kTile + k];
        const float p = sc == -INFINITY ? 0.0f : exp(sc - m_new);
        s_tile[r * kTile + k] = p;
        sum += p;
      }
      row_max[r] = m_new;
      row_sum[r] = sum;
      diag[r * kTile + r] = resc;
    }
    for (uint d0 = 0; d0 < D; d0 += KC) {
      for (uint i = lane; i < kTile * KC; i += kSimdWidth) {
        const int j = j0 + int(i / KC);
        const int64_t slot = j < ctx ? cache_row(table, j, args) : -1;
        kv_tile[i] = slot >= 0 ? float(value_cache[slot * row_elems + int64_t(kv_head) * D + d0 + i % KC]) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // and P, diag of lanes 0-7
      simdgroup_float8x8 dm;
      simdgroup_float8x8 pm;
      simdgroup_load(dm, diag, kTile);
      simdgroup_load(pm, s_tile, kTile);
      for (uint b = 0; b < KC / kTile; ++b) {
        simdgroup_float8x8 vm;
        simdgroup_load(vm, kv_tile + b * kTile, KC);
        simdgroup_multiply(o[d0 / kTile + b], dm, o[d0 / kTile + b]);
        simdgroup_multiply_accumulate(o[d0 / kTile + b], pm, vm, o[d0 / kTile + b]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
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
    const int r = int(i / D);
    out[(int64_t(q_start + tile_start + r) * args.num_q_heads + head) * D + i % D] = T(q_tile[i]);
  }
}

#define instantiate_paged_attention(tname, T, D)                                            \
  template [[host_name("paged_attention_decode_" #tname "_d" #D)]] kernel decltype(         \
      paged_attention_decode<T, D>) paged_attention_decode<T, D>;                           \
  template [[host_name("paged_attention_reduce_" #tname "_d" #D)]] kernel decltype(         \
      paged_attention_reduce<T, D>) paged_attention_reduce<T, D>;                           \
  template [[host_name("paged_attention_prefill_" #tname "_d" #D)]] kernel decltype(        \
      paged_attention_prefill<T, D>) paged_attention_prefill<T, D>;

// Head sizes of the supported architectures (metal_head_sizes() in paged_attention.cpp).
#define instantiate_paged_attention_heads(tname, T) \
  instantiate_paged_attention(tname, T, 48)         \
  instantiate_paged_attention(tname, T, 64)         \
  instantiate_paged_attention(tname, T, 80)         \
  instantiate_paged_attention(tname, T, 96)         \
  instantiate_paged_attention(tname, T, 120)        \
  instantiate_paged_attention(tname, T, 128)        \
  instantiate_paged_attention(tname, T, 256)        \
  instantiate_paged_attention(tname, T, 512)

instantiate_paged_attention_heads(float32, float)
instantiate_paged_attention_heads(float16, half)
instantiate_paged_attention_heads(bfloat16, bfloat)
