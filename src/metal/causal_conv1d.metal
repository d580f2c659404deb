// Depthwise causal conv1d (+ SiLU) over packed variable-length rows, reading
// and updating each sequence's conv state (the last K - 1 inputs, oldest
// first):  out[t, c] = silu(bias[c] + sum_j w[c, j] * in[t - (K - 1) + j, c])
// where inputs before the sequence's first row come from the state.
// One thread per (sequence, channel): the window lives in registers for all of
// the sequence's rows; no threadgroup memory, no barriers.
#include <metal_stdlib>
#include "causal_conv1d_args.h"

using namespace metal;

constant constexpr uint kMaxWidth = 8;

template <typename T>
kernel void causal_conv1d(
    device const T* x [[buffer(0)]],
    device const T* bias [[buffer(1)]],
    device const T* weight [[buffer(2)]],
    device const int* cu_seqlens [[buffer(3)]],
    device const int* slots [[buffer(4)]],
    device const int* has_initial_state [[buffer(5)]],
    device T* state [[buffer(6)]],
    device T* out [[buffer(7)]],
    constant CausalConv1dArgs& args [[buffer(8)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 tid [[thread_position_in_threadgroup]],
    uint2 ntg [[threads_per_threadgroup]]) {
  const uint c = group.x * ntg.x + tid.x;
  const uint n = group.y;
  if (c >= args.channels) {
    return;
  }
  const uint k = args.width;
  const uint m = k - 1u;
  device T* st = state + (ulong(slots[n]) * args.channels + c) * m;
  const bool init = has_initial_state[n] != 0;
  float w[kMaxWidth];
  float win[kMaxWidth];  // win[0..m) = past inputs, oldest first
  for (uint j = 0; j < kMaxWidth; ++j) {
    w[j] = j < k ? float(weight[ulong(c) * k + j]) : 0.0f;
    win[j] = (j < m && init) ? float(st[j]) : 0.0f;
  }
  const float b = args.has_bias != 0u ? float(bias[c]) : 0.0f;
  for (int t = cu_seqlens[n]; t < cu_seqlens[n + 1]; ++t) {
    const float cur = float(x[ulong(t) * args.channels + c]);
    float acc = b + w[m] * cur;
    for (uint j = 0; j < kMaxWidth; ++j) {
      if (j < m) {
        acc += w[j] * win[j];
      }
    }
    for (uint j = 0; j + 1u < kMaxWidth; ++j) {
      if (j + 1u < m) {
        win[j] = win[j + 1u];
      }
    }
    win[m - 1u] = cur;
    out[ulong(t) * args.channels + c] = T(args.silu != 0u ? acc / (1.0f + exp(-acc)) : acc);
  }
  for (uint j = 0; j < m; ++j) {
    st[j] = T(win[j]);
  }
}

// out = in, element by element (the new state when the old one is still held).
template <typename T>
kernel void causal_conv1d_copy_state(
    device const T* src [[buffer(0)]],
    device T* dst [[buffer(1)]],
    constant ConvStateCopyArgs& args [[buffer(2)]],
    uint i [[thread_position_in_grid]]) {
  if (i < args.count) {
    dst[i] = src[i];
  }
}

#define instantiate_causal_conv1d(tname, T)                                          \
  template [[host_name("causal_conv1d_" #tname)]] kernel decltype(causal_conv1d<T>)  \
      causal_conv1d<T>;                                                              \
  template [[host_name("causal_conv1d_copy_state_" #tname)]] kernel decltype(        \
      causal_conv1d_copy_state<T>) causal_conv1d_copy_state<T>;

instantiate_causal_conv1d(float32, float)
instantiate_causal_conv1d(float16, half)
instantiate_causal_conv1d(bfloat16, bfloat)
