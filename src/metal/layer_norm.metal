// LayerNorm, optionally of a residual sum (BERT's post-LN blocks):
//   h = x (+ residual, rounded to T), out = T((h - mean) / sqrt(var + eps) * weight + bias)
// One threadgroup per row; mean, then variance around it, each reduced in float32 through
// simd_sum and a threadgroup scratch of one float per simdgroup (the CPU kernel,
// cpu/layer_norm.h, takes the same two passes).
#include <metal_stdlib>
#include "layer_norm_args.h"

using namespace metal;

constant constexpr uint kLnMaxSimdgroups = 32;

// Sum of `v` over the threadgroup; every thread gets the result. The barrier before the
// scratch is written lets a second call reuse it.
inline float ln_threadgroup_sum(float v, threadgroup float* scratch, uint ntg, uint sg, uint lane) {
  float s = simd_sum(v);
  uint nsg = (ntg + 31) / 32;
  if (nsg == 1) {
    return s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane == 0) {
    scratch[sg] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < nsg; ++i) {
    total += scratch[i];
  }
  return total;
}

template <typename T>
inline float ln_h(device const T* x, device const T* r, bool add, uint i) {
  return add ? float(T(float(x[i]) + float(r[i]))) : float(x[i]);
}

template <typename T>
kernel void layer_norm(
    device const T* x [[buffer(0)]],
    device const T* residual [[buffer(1)]],
    device const T* weight [[buffer(2)]],
    device const T* bias [[buffer(3)]],
    device T* out [[buffer(4)]],
    constant LayerNormArgs& args [[buffer(5)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[kLnMaxSimdgroups];
  const ulong base = ulong(row) * args.hidden;
  device const T* xr = x + base;
  device const T* rr = residual + base;
  device T* yr = out + base;
  const bool add = args.residual != 0u;
  const float n = float(args.hidden);

  float sum = 0.0f;
  for (uint i = tid; i < args.hidden; i += ntg) {
    sum += ln_h(xr, rr, add, i);
  }
  const float mean = ln_threadgroup_sum(sum, scratch, ntg, sg, lane) / n;
  float ss = 0.0f;
  for (uint i = tid; i < args.hidden; i += ntg) {
    const float d = ln_h(xr, rr, add, i) - mean;
    ss += d * d;
  }
  const float inv = rsqrt(ln_threadgroup_sum(ss, scratch, ntg, sg, lane) / n + args.eps);
  for (uint i = tid; i < args.hidden; i += ntg) {
    yr[i] = T((ln_h(xr, rr, add, i) - mean) * inv * float(weight[i]) + float(bias[i]));
  }
}

#define instantiate_layer_norm(tname, T) \
  template [[host_name("layer_norm_" #tname)]] kernel decltype(layer_norm<T>) layer_norm<T>;

instantiate_layer_norm(float32, float)
instantiate_layer_norm(float16, half)
instantiate_layer_norm(bfloat16, bfloat)
