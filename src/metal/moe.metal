// Fused mixture-of-experts MLP (Qwen3-MoE style), four launches:
//   moe_route    one thread per token: top-k of the router logits (ties to the
//                lower expert id), softmax over all E or sigmoid scores, optional
//                renormalisation -> ids [T, k], weights [T, k]
//   moe_gate_up  grid (row blocks, E): a simdgroup per row i of expert e's gate and
//                up weights, looping over the (token, slot) pairs routed to e, so
//                each expert row is read once per step -> act[s, i] = silu(g) * u
//   moe_down     grid (row blocks, E): the same for the down rows -> y[s, h]
//   moe_combine  out[t, h] = sum_j weights[t, j] * y[t * k + j, h], in slot order
// args.flags adds gpt-oss's variations (moe_args.h): weights = softmax over the k chosen
// logits; per-expert biases on gate/up/down; the clamped SwiGLU.
// All arithmetic is float32; one rounding per output.
#include <metal_stdlib>
#include "moe_args.h"

using namespace metal;

constant constexpr uint kRowsPerGroup = 4;  // simdgroups per threadgroup, one row each

// true when (v, i) comes after (pv, pi) in the order "larger logit first, then lower id"
inline bool after(float v, uint i, float pv, uint pi) {
  return v < pv || (v == pv && i > pi);
}

kernel void moe_route(
    device const float* logits [[buffer(0)]],
    device int* ids [[buffer(1)]],
    device float* weights [[buffer(2)]],
    constant MoeArgs& args [[buffer(3)]],
    uint t [[thread_position_in_grid]]) {
  if (t >= args.num_tokens) {
    return;
  }
  device const float* row = logits + ulong(t) * args.num_experts;
  float mx = -INFINITY;
  for (uint e = 0; e < args.num_experts; ++e) {
    mx = max(mx, row[e]);
  }
  float denom = 0.0f;
  if (args.sigmoid == 0u) {
    for (uint e = 0; e < args.num_experts; ++e) {
      denom += exp(row[e] - mx);
    }
  }
  const bool topk_softmax = (args.flags & kMoeTopkSoftmax) != 0u;
  float pv = INFINITY;
  uint pi = 0;
  float total = 0.0f;
  float first = 0.0f;
  for (uint j = 0; j < args.top_k; ++j) {
    float best = -INFINITY;
    uint bi = args.num_experts;
    for (uint e = 0; e < args.num_experts; ++e) {
      float v = row[e];
      bool ok = j == 0u || after(v, e, pv, pi);
      if (ok && (bi == args.num_experts || v > best)) {
        best = v;
        bi = e;
      }
    }
    pv = best;
    pi = bi;
    if (j == 0u) {
      first = best;
    }
    float w = topk_softmax ? exp(best - first)
              : args.sigmoid != 0u ? 1.0f / (1.0f + exp(-best))
                                   : exp(best - mx) / denom;
    ids[ulong(t) * args.top_k + j] = int(bi);
    weights[ulong(t) * args.top_k + j] = w;
    total += w;
  }
  if ((args.renormalize != 0u || topk_softmax) && total > 0.0f) {
    for (uint j = 0; j < args.top_k; ++j) {
      weights[ulong(t) * args.top_k + j] /= total;
    }
  }
}

template <typename T, typename W>
kernel void moe_gate_up(
    device const T* x [[buffer(0)]],
    device const W* w_gate [[buffer(1)]],
    device const W* w_up [[buffer(2)]],
    device const int* ids [[buffer(3)]],
    device float* act [[buffer(4)]],
    constant MoeArgs& args [[buffer(5)]],
    device const float* b_gate [[buffer(6)]],  // [E, I] when kMoeBias
    device const float* b_up [[buffer(7)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint i = group.x * kRowsPerGroup + sg;
  const uint e = group.y;
  if (i >= args.inter) {
    return;
  }
  const bool bias = (args.flags & kMoeBias) != 0u;
  const float bg = bias ? b_gate[ulong(e) * args.inter + i] : 0.0f;
  const float bu = bias ? b_up[ulong(e) * args.inter + i] : 0.0f;
  const ulong off = (ulong(e) * args.inter + i) * args.hidden;
  device const W* g_row = w_gate + off;
  device const W* u_row = w_up + off;
  const uint slots = args.num_tokens * args.top_k;
  for (uint s = 0; s < slots; ++s) {
    if (ids[s] != int(e)) {
      continue;
    }
    device const T* xr = x + ulong(s / args.top_k) * args.hidden;
    float g = 0.0f;
    float u = 0.0f;
    for (uint c = lane; c < args.hidden; c += 32u) {
      float xv = float(xr[c]);
      g += xv * float(g_row[c]);
      u += xv * float(u_row[c]);
    }
    g = simd_sum(g);
    u = simd_sum(u);
    if (lane == 0u) {
      act[ulong(s) * args.inter + i] = moe_activation(g + bg, u + bu, args.flags);
    }
  }
}

template <typename W>
kernel void moe_down(
    device const float* act [[buffer(0)]],
    device const W* w_down [[buffer(1)]],
    device const int* ids [[buffer(2)]],
    device float* y [[buffer(3)]],
    constant MoeArgs& args [[buffer(4)]],
    device const float* b_down [[buffer(5)]],  // [E, H] when kMoeBias
    uint2 group [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint h = group.x * kRowsPerGroup + sg;
  const uint e = group.y;
  if (h >= args.hidden) {
    return;
  }
  const float bd = (args.flags & kMoeBias) != 0u ? b_down[ulong(e) * args.hidden + h] : 0.0f;
  device const W* d_row = w_down + (ulong(e) * args.hidden + h) * args.inter;
  const uint slots = args.num_tokens * args.top_k;
  for (uint s = 0; s < slots; ++s) {
    if (ids[s] != int(e)) {
      continue;
    }
    device const float* ar = act + ulong(s) * args.inter;
    float d = 0.0f;
    for (uint c = lane; c < args.inter; c += 32u) {
      d += ar[c] * float(d_row[c]);
    }
    d = simd_sum(d);
    if (lane == 0u) {
      y[ulong(s) * args.hidden + h] = d + bd;
    }
  }
}

template <typename T>
kernel void moe_combine(
    device const float* y [[buffer(0)]],
    device const float* weights [[buffer(1)]],
    device T* out [[buffer(2)]],
    constant MoeArgs& args [[buffer(3)]],
    uint2 pos [[thread_position_in_grid]]) {
  const uint h = pos.x;
  const uint t = pos.y;
  if (h >= args.hidden || t >= args.num_tokens) {
    return;
  }
  float acc = 0.0f;
  for (uint j = 0; j < args.top_k; ++j) {
    const ulong s = ulong(t) * args.top_k + j;
    acc += weights[s] * y[s * args.hidden + h];
  }
  out[ulong(t) * args.hidden + h] = T(acc);
}

#define instantiate_moe_gate_up(tname, T, wname, W)                                       \
  template [[host_name("moe_gate_up_" #tname "_" #wname)]] kernel decltype(moe_gate_up<T, W>) \
      moe_gate_up<T, W>;

#define instantiate_moe_weights(wname, W)                                                 \
  instantiate_moe_gate_up(float32, float, wname, W)                                       \
  instantiate_moe_gate_up(float16, half, wname, W)                                        \
  instantiate_moe_gate_up(bfloat16, bfloat, wname, W)                                     \
  template [[host_name("moe_down_" #wname)]] kernel decltype(moe_down<W>) moe_down<W>;     \
  template [[host_name("moe_combine_" #wname)]] kernel decltype(moe_combine<W>) moe_combine<W>;

instantiate_moe_weights(float32, float)
instantiate_moe_weights(float16, half)
instantiate_moe_weights(bfloat16, bfloat)
