// RMS normalization, optionally fused with the residual add:
//   h   = x (+ residual, rounded to T and written to residual_out)
//   out = T(h * rsqrt(mean(h^2) + eps) * weight)
// One threadgroup per row; the sum of squares is reduced in float32 through
// simd_sum and a threadgroup scratch of one float per simdgroup.
#include <metal_stdlib>
#include "rms_norm_args.h"

using namespace metal;

constant constexpr uint kMaxSimdgroups = 32;

// Sum of `v` over the threadgroup; every thread gets the result.
inline float threadgroup_sum(float v, threadgroup float* scratch, uint ntg, uint sg, uint lane) {
  float s = simd_sum(v);
  uint nsg = (ntg + 31) / 32;
  if (nsg == 1) {
    return s;
  }
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
kernel void rms_norm(
    device const T* x [[buffer(0)]],
    device const T* weight [[buffer(1)]],
    device T* out [[buffer(2)]],
    constant RmsNormArgs& args [[buffer(3)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[kMaxSimdgroups];
  device const T* xr = x + row * args.x_row_stride;
  device T* yr = out + row * args.out_row_stride;

  float sum_sq = 0.0f;
  for (uint i = tid; i < args.hidden; i += ntg) {
    float v = float(xr[i]);
    sum_sq += v * v;
  }
  float total = threadgroup_sum(sum_sq, scratch, ntg, sg, lane);
  float inv_rms = rsqrt(total / float(args.hidden) + args.eps);
  for (uint i = tid; i < args.hidden; i += ntg) {
    yr[i] = T(float(xr[i]) * inv_rms * float(weight[i]));
  }
}

template <typename T>
kernel void add_rms_norm(
    device const T* x [[buffer(0)]],
    device const T* residual [[buffer(1)]],
    device const T* weight [[buffer(2)]],
    device T* out [[buffer(3)]],
    device T* residual_out [[buffer(4)]],
    constant RmsNormArgs& args [[buffer(5)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scratch[kMaxSimdgroups];
  device const T* xr = x + row * args.x_row_stride;
  device const T* rr = residual + row * args.residual_row_stride;
  device T* yr = out + row * args.out_row_stride;
  device T* hr = residual_out + row * args.out_row_stride;

  float sum_sq = 0.0f;
  for (uint i = tid; i < args.hidden; i += ntg) {
    // the norm sees the rounded sum, exactly what residual_out holds
    T h = T(float(xr[i]) + float(rr[i]));
    hr[i] = h;
    sum_sq += float(h) * float(h);
  }
  float total = threadgroup_sum(sum_sq, scratch, ntg, sg, lane);
  float inv_rms = rsqrt(total / float(args.hidden) + args.eps);
  for (uint i = tid; i < args.hidden; i += ntg) {
    yr[i] = T(float(hr[i]) * inv_rms * float(weight[i]));
  }
}

#define instantiate_rms_norm(tname, T)                                             \
  template [[host_name("rms_norm_" #tname)]] kernel decltype(rms_norm<T>) rms_norm<T>; \
  template [[host_name("add_rms_norm_" #tname)]] kernel decltype(add_rms_norm<T>)      \
      add_rms_norm<T>;

instantiate_rms_norm(float32, float)
instantiate_rms_norm(float16, half)
instantiate_rms_norm(bfloat16, bfloat)
