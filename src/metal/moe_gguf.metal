// fused_moe with GGUF expert weights: the gate/up and down launches of moe.metal
// (routing and the combine are moe.metal's kernels), decoding weight rows with the
// GGUF mat-vec core (gguf_matvec_core.h). A simdgroup owns one weight row of expert
// e and walks the slots routed to e in groups of up to kGgufMvMaxX, so each decoded
// piece of the row serves every slot of the group. Float32 sums.
#include <metal_stdlib>
#include "gguf_matvec_core.h"
#include "moe_args.h"

using namespace metal;

constant constexpr uint kMoeRowsPerGroup = 4;  // simdgroups per threadgroup

// Rows of x picked by index: x.at(i, j) = x[rows[i] * stride + j].
template <typename T>
struct MoeGatheredX {
  device const T* x;
  ulong stride;
  uint rows[kGgufMvMaxX];
  float at(uint i, uint j) const { return float(x[ulong(rows[i]) * stride + j]); }
};

// Collects the next (up to kGgufMvMaxX) slots routed to expert e from slot `from`;
// returns how many and sets `from` past the last one examined.
inline uint moe_next_slots(device const int* ids, uint slots, uint e, thread uint& from,
                           thread uint (&out)[kGgufMvMaxX]) {
  uint n = 0;
  while (from < slots && n < kGgufMvMaxX) {
    if (ids[from] == int(e)) {
      out[n] = from;
      n += 1u;
    }
    from += 1u;
  }
  return n;
}

template <typename T>
kernel void moe_gguf_gate_up(
    device const T* x [[buffer(0)]],
    device const uchar* w_gate [[buffer(1)]],
    device const uchar* w_up [[buffer(2)]],
    device const int* ids [[buffer(3)]],
    device float* act [[buffer(4)]],
    constant MoeGgufArgs& args [[buffer(5)]],
    device const float* b_gate [[buffer(6)]],  // [E, I] when kMoeBias
    device const float* b_up [[buffer(7)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint i = group.x * kMoeRowsPerGroup + sg;
  const uint e = group.y;
  const uint inter = args.moe.inter;
  const uint k = args.moe.hidden;
  if (i >= inter) {
    return;
  }
  const bool bias = (args.moe.flags & kMoeBias) != 0u;
  const float bg = bias ? b_gate[ulong(e) * inter + i] : 0.0f;
  const float bu = bias ? b_up[ulong(e) * inter + i] : 0.0f;
  GgufMvRowsTyped g;
  g.type = args.gate_type;
  g.w = w_gate + (ulong(e) * inter + i) * args.gate_row_bytes;
  g.row_bytes = args.gate_row_bytes;
  g.k = k;
  GgufMvRowsTyped u;
  u.type = args.up_type;
  u.w = w_up + (ulong(e) * inter + i) * args.up_row_bytes;
  u.row_bytes = args.up_row_bytes;
  u.k = k;
  MoeGatheredX<T> xs;
  xs.x = x;
  xs.stride = k;
  uint slot[kGgufMvMaxX];
  const uint slots = args.moe.num_tokens * args.moe.top_k;
  uint from = 0;
  for (;;) {
    const uint n = moe_next_slots(ids, slots, e, from, slot);
    if (n == 0u) {
      break;
    }
    for (uint j = 0; j < n; ++j) {
      xs.rows[j] = slot[j] / args.moe.top_k;
    }
    float acc_g[kGgufMvMaxRowsPerLane][kGgufMvMaxX];
    float acc_u[kGgufMvMaxRowsPerLane][kGgufMvMaxX];
    gguf_mv_clear(acc_g);
    gguf_mv_clear(acc_u);
    gguf_mv_partial_any(args.piece, g, 1u, xs, n, k, lane, 32u, acc_g);
    gguf_mv_partial_any(args.piece, u, 1u, xs, n, k, lane, 32u, acc_u);
    for (uint j = 0; j < n; ++j) {
      const float gs = simd_sum(acc_g[0][j]);
      const float us = simd_sum(acc_u[0][j]);
      if (lane == 0u) {
        act[ulong(slot[j]) * inter + i] = moe_activation(gs + bg, us + bu, args.moe.flags);
      }
    }
  }
}

kernel void moe_gguf_down(
    device const float* act [[buffer(0)]],
    device const uchar* w_down [[buffer(1)]],
    device const int* ids [[buffer(2)]],
    device float* y [[buffer(3)]],
    constant MoeGgufArgs& args [[buffer(4)]],
    device const float* b_down [[buffer(5)]],  // [E, H] when kMoeBias
    uint2 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint h = group.x * kMoeRowsPerGroup + sg;
  const uint e = group.y;
  const uint hidden = args.moe.hidden;
  const uint k = args.moe.inter;
  if (h >= hidden) {
    return;
  }
  const float bd = (args.moe.flags & kMoeBias) != 0u ? b_down[ulong(e) * hidden + h] : 0.0f;
  GgufMvRowsTyped d;
  d.type = args.down_type;
  d.w = w_down + (ulong(e) * hidden + h) * args.down_row_bytes;
  d.row_bytes = args.down_row_bytes;
  d.k = k;
  MoeGatheredX<float> as;
  as.x = act;
  as.stride = k;
  uint slot[kGgufMvMaxX];
  const uint slots = args.moe.num_tokens * args.moe.top_k;
  uint from = 0;
  for (;;) {
    const uint n = moe_next_slots(ids, slots, e, from, slot);
    if (n == 0u) {
      break;
    }
    for (uint j = 0; j < n; ++j) {
      as.rows[j] = slot[j];
    }
    float acc[kGgufMvMaxRowsPerLane][kGgufMvMaxX];
    gguf_mv_clear(acc);
    gguf_mv_partial_any(args.piece, d, 1u, as, n, k, lane, 32u, acc);
    for (uint j = 0; j < n; ++j) {
      const float s = simd_sum(acc[0][j]);
      if (lane == 0u) {
        y[ulong(slot[j]) * hidden + h] = s + bd;
      }
    }
  }
}

template [[host_name("moe_gguf_gate_up_float32")]] kernel decltype(moe_gguf_gate_up<float>)
    moe_gguf_gate_up<float>;
template [[host_name("moe_gguf_gate_up_float16")]] kernel decltype(moe_gguf_gate_up<half>)
    moe_gguf_gate_up<half>;
template [[host_name("moe_gguf_gate_up_bfloat16")]] kernel decltype(moe_gguf_gate_up<bfloat>)
    moe_gguf_gate_up<bfloat>;
