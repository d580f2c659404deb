// lora_apply: out[t] = y[t] + B[s] @ (scale[s] * A[s] @ x[t]), s = row_slot[t]
// (-1: out[t] = y[t]). One threadgroup per (block of output columns, row):
// its simdgroups first reduce h = scale * A[s] x into threadgroup memory (one
// rank per simdgroup pass, lanes striding over in), then each thread sums one
// output column over the ranks. float32 throughout, one rounding per output.
#include <metal_stdlib>
#include "lora_args.h"

using namespace metal;

template <typename T>
kernel void lora_apply(
    device const T* y [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device const T* lora_a [[buffer(2)]],
    device const T* lora_b [[buffer(3)]],
    device const float* scale [[buffer(4)]],
    device const int* row_slot [[buffer(5)]],
    device T* out [[buffer(6)]],
    constant LoraApplyArgs& args [[buffer(7)]],
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint ntg [[threads_per_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float h[LORA_MAX_RANK];
  const uint row = tg.y;
  const uint col = tg.x * ntg + tid;
  const int s = row_slot[row];
  device const T* yr = y + ulong(row) * args.out_dim;
  device T* outr = out + ulong(row) * args.out_dim;
  if (s < 0) {  // uniform over the threadgroup: no barrier is skipped by some threads only
    if (col < args.out_dim) {
      outr[col] = yr[col];
    }
    return;
  }
  device const T* xr = x + ulong(row) * args.in_dim;
  device const T* as = lora_a + ulong(s) * args.rank * args.in_dim;
  const uint nsg = (ntg + 31) / 32;
  for (uint r = sg; r < args.rank; r += nsg) {
    device const T* ar = as + ulong(r) * args.in_dim;
    float acc = 0.0f;
    for (uint i = lane; i < args.in_dim; i += 32) {
      acc += float(ar[i]) * float(xr[i]);
    }
    acc = simd_sum(acc);
    if (lane == 0) {
      h[r] = acc * scale[s];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (col >= args.out_dim) {
    return;
  }
  device const T* br = lora_b + (ulong(s) * args.out_dim + col) * args.rank;
  float acc = 0.0f;
  for (uint r = 0; r < args.rank; ++r) {
    acc += float(br[r]) * h[r];
  }
  outr[col] = T(float(yr[col]) + acc);
}

#define instantiate_lora_apply(tname, T)                                                    \
  template [[host_name("lora_apply_" #tname)]] kernel decltype(lora_apply<T>) lora_apply<T>;

instantiate_lora_apply(float32, float)
instantiate_lora_apply(float16, half)
instantiate_lora_apply(bfloat16, bfloat)
