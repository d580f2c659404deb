// Gated delta rule, recurrent form over packed variable-length rows (decode and
// prefill of many short rows in one launch). Per sequence n, value head h
// (key head h / (hv / hk)) and token t, with q, k L2-normalized (q also times
// 1/sqrt(dk)), g = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b):
//   S = g S + beta (v - g S k) k^T,  y = S q        (S: [dv, dk], float32)
// One simdgroup per state row: rows are independent, so a row lives in the
// lanes' registers (dk / 32 each) for all of the sequence's tokens; the dot
// products are simd_sums. No threadgroup memory, no barriers.
#include <metal_stdlib>
#include "gated_delta_args.h"

using namespace metal;

constant constexpr uint kMaxPerLane = 8;  // dk <= 256
constant constexpr uint kRowsPerGroup = 4;

inline float softplus(float x) {
  return x > 20.0f ? x : log(1.0f + exp(x));
}

template <typename T>
kernel void gated_delta_recurrent(
    device const T* q [[buffer(0)]],
    device const T* k [[buffer(1)]],
    device const T* v [[buffer(2)]],
    device const float* a [[buffer(3)]],
    device const float* b [[buffer(4)]],
    device const float* a_log [[buffer(5)]],
    device const float* dt_bias [[buffer(6)]],
    device const int* cu_seqlens [[buffer(7)]],
    device const int* slots [[buffer(8)]],
    device const int* has_initial_state [[buffer(9)]],
    device float* state [[buffer(10)]],
    device T* y [[buffer(11)]],
    constant GatedDeltaArgs& args [[buffer(12)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 tid [[thread_position_in_threadgroup]]) {
  const uint n = group.x / args.hv;
  const uint h = group.x % args.hv;
  const uint r = group.y * kRowsPerGroup + tid.y;
  const uint lane = tid.x;
  if (r >= args.dv) {
    return;  // the whole simdgroup leaves together
  }
  const uint kh = h / (args.hv / args.hk);
  const uint per_lane = (args.dk + 31u) / 32u;
  device float* row = state + ((ulong(slots[n]) * args.hv + h) * args.dv + r) * args.dk;
  const bool init = has_initial_state[n] != 0;
  float s[kMaxPerLane];
  for (uint i = 0; i < kMaxPerLane; ++i) {
    const uint e = lane + 32u * i;
    s[i] = (i < per_lane && e < args.dk && init) ? row[e] : 0.0f;
  }
  const float decay_rate = exp(a_log[h]);
  for (int t = cu_seqlens[n]; t < cu_seqlens[n + 1]; ++t) {
    device const T* kt = k + (ulong(t) * args.hk + kh) * args.dk;
    device const T* qt = q + (ulong(t) * args.hk + kh) * args.dk;
    float kk[kMaxPerLane];
    float qq[kMaxPerLane];
    float ksq = 0.0f;
    float qsq = 0.0f;
    for (uint i = 0; i < kMaxPerLane; ++i) {
      const uint e = lane + 32u * i;
      const bool in = i < per_lane && e < args.dk;
      kk[i] = in ? float(kt[e]) : 0.0f;
      qq[i] = in ? float(qt[e]) : 0.0f;
      ksq += kk[i] * kk[i];
      qsq += qq[i] * qq[i];
    }
    const float kinv = rsqrt(simd_sum(ksq) + args.eps);
    const float qinv = args.q_scale * rsqrt(simd_sum(qsq) + args.eps);
    const ulong th = ulong(t) * args.hv + h;
    const float g = exp(-decay_rate * softplus(a[th] + dt_bias[h]));
    const float beta = 1.0f / (1.0f + exp(-b[th]));
    float kv = 0.0f;
    for (uint i = 0; i < kMaxPerLane; ++i) {
      kk[i] *= kinv;
      kv += s[i] * kk[i];
    }
    const float delta = beta * (float(v[th * args.dv + r]) - g * simd_sum(kv));
    float out = 0.0f;
    for (uint i = 0; i < kMaxPerLane; ++i) {
      s[i] = g * s[i] + delta * kk[i];
      out += s[i] * qq[i];
    }
    out = simd_sum(out) * qinv;
    if (lane == 0u) {
      y[th * args.dv + r] = T(out);
    }
  }
  for (uint i = 0; i < per_lane; ++i) {
    const uint e = lane + 32u * i;
    if (e < args.dk) {
      row[e] = s[i];
    }
  }
}

// out = in, element by element (the new state when the old one is still held).
kernel void gated_delta_copy_state(
    device const float* src [[buffer(0)]],
    device float* dst [[buffer(1)]],
    constant StateCopyArgs& args [[buffer(2)]],
    uint i [[thread_position_in_grid]]) {
  if (i < args.count) {
    dst[i] = src[i];
  }
}

#define instantiate_gated_delta(tname, T)                                        \
  template [[host_name("gated_delta_recurrent_" #tname)]] kernel decltype(       \
      gated_delta_recurrent<T>) gated_delta_recurrent<T>;

instantiate_gated_delta(float32, float)
instantiate_gated_delta(float16, half)
instantiate_gated_delta(bfloat16, bfloat)
