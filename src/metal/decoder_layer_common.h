// Shared pieces of the fused decoder-layer kernels (decoder_layer.metal only): the
// function constants, the row sources the mat-vec core (gguf_matvec_core.h, the loop of
// gguf_matvec) reads activations through, and the RMS reductions in rms_norm.metal's
// order. MSL only.
#pragma once

#include <metal_stdlib>
#include "decoder_layer_args.h"
#include "gguf_matvec_core.h"

using namespace metal;

constant uint fc_type0 [[function_constant(0)]];  // q / gate / the mat-vec's weight
constant uint fc_type1 [[function_constant(1)]];  // k / up
constant uint fc_type2 [[function_constant(2)]];  // v
constant bool fc_bias [[function_constant(3)]];
constant bool fc_qk_norm [[function_constant(4)]];
constant bool fc_neox [[function_constant(5)]];
constant bool fc_residual [[function_constant(6)]];
constant bool fc_sandwich [[function_constant(7)]];
constant bool fc_gelu [[function_constant(8)]];
constant bool fc_staged [[function_constant(9)]];  // normalised rows in threadgroup memory
constant bool fc_projected [[function_constant(10)]];  // layer_qkv: q, k, v come projected
// layer_matvec (o): x is split-KV attention; stage it by combining the partitions (the
// reduce folded in). Implies fc_staged.
constant bool fc_combine [[function_constant(11)]];

constant constexpr uint kLayerMaxSimdgroups = 32;
constant constexpr uint kLayerMaxRows = kGgufMvMaxX;  // x rows per threadgroup

// Rows of a dense [rows, stride] activation.
template <typename T>
struct LayerRows {
  device const T* x;
  uint stride;
  float at(uint i, uint j) const { return float(x[i * stride + j]); }
};

// The residual stream entering the MLP: x itself, or (gemma) T(res + T(norm_a(x))).
template <typename T>
struct LayerResidual {
  device const T* x;
  device const T* res;
  device const T* wa;
  uint stride;
  float inv_x[kLayerMaxRows];
  float at(uint i, uint j) const {
    if (!fc_sandwich) {
      return float(x[i * stride + j]);
    }
    T a = T(float(x[i * stride + j]) * inv_x[i] * float(wa[j]));
    return float(T(float(res[i * stride + j]) + float(a)));
  }
};

// RMSNorm of a row source, as rms_norm.metal writes it: T(x * inv_rms * w).
template <typename T, typename X>
struct LayerNormed {
  X src;
  device const T* w;
  float inv[kLayerMaxRows];
  float at(uint i, uint j) const { return float(T(src.at(i, j) * inv[i] * float(w[j]))); }
};

// Rows kept in threadgroup memory, [rows][stride], exactly the values the source gives.
template <typename T>
struct LayerStaged {
  threadgroup const T* x;
  uint stride;
  float at(uint i, uint j) const { return float(x[i * stride + j]); }
};

// Writes src's rows into xs (all threads), then a barrier.
template <typename T, typename X>
inline void layer_stage(thread const X& src, threadgroup T* xs, uint width, uint rows, uint tid,
                        uint ntg) {
  for (uint j = tid; j < width; j += ntg) {
    for (uint i = 0; i < rows; ++i) {
      xs[i * width + j] = T(src.at(i, j));
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// The lane's share of its weight rows (w: `wrows` lane rows) . the rows of x, into acc:
// x from the staged copy, or normalised on the fly; gguf_matvec's loop and order.
template <typename T, typename W, typename X>
inline void layer_mv_partial(thread const W& w, uint wrows, thread const X& x,
                             threadgroup const T* xs, uint xrows,
                             constant DecoderLayerArgs& args, uint first,
                             thread float (&acc)[kGgufMvMaxRowsPerLane][kGgufMvMaxX]) {
  if (fc_staged) {
    LayerStaged<T> st;
    st.x = xs;
    st.stride = args.k;
    gguf_mv_partial_any(args.piece, w, wrows, st, xrows, args.k, first, args.lanes_per_row, acc);
  } else {
    gguf_mv_partial_any(args.piece, w, wrows, x, xrows, args.k, first, args.lanes_per_row, acc);
  }
}

// The weight rows [row0, row0 + ...) of a matrix of GGML type `type`.
inline GgufMvRowsTyped layer_rows(uint type, device const uchar* w, ulong row_bytes, uint row0,
                                  uint k) {
  GgufMvRowsTyped r;
  r.type = type;
  r.w = w + ulong(row0) * row_bytes;
  r.row_bytes = row_bytes;
  r.k = k;
  return r;
}

// act(g) * u in float32: silu(g) = g / (1 + e^-g), or (fc_gelu) tanh GELU
// = g / (1 + e^(-2 sqrt(2/pi) (g + 0.044715 g^3))).
inline float layer_gated(float g, float u) {
  float z = fc_gelu ? -1.5957691216057308f * (g + 0.044715f * g * g * g) : -g;
  return g / (1.0f + exp(z)) * u;
}

// Sums part[i], i < rows, over the threadgroup in rms_norm.metal's order: each
// simdgroup's simd_sum, then the simdgroups' sums in index order (simdgroups with
// nothing to add give +0, which changes no sum). Every thread gets the totals.
inline void layer_row_sums(thread const float* part, uint rows, threadgroup float* red,
                           uint nsg, uint sg, uint lane, thread float* total) {
  for (uint i = 0; i < rows; ++i) {
    float s = simd_sum(part[i]);
    if (lane == 0) {
      red[i * kLayerMaxSimdgroups + sg] = s;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = 0; i < rows; ++i) {
    float t = 0.0f;
    for (uint g = 0; g < nsg; ++g) {
      t += red[i * kLayerMaxSimdgroups + g];
    }
    total[i] = t;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // red is reused
}

// inv[i] = rsqrt(mean(row i ^ 2) + eps); the first `active` threads walk the row.
template <typename X>
inline void layer_inv_rms(thread const X& src, uint width, uint rows, uint active, float eps,
                          uint tid, threadgroup float* red, uint nsg, uint sg, uint lane,
                          thread float* inv) {
  float part[kLayerMaxRows];
  for (uint i = 0; i < kLayerMaxRows; ++i) {
    part[i] = 0.0f;
  }
  if (tid < active) {
    for (uint j = tid; j < width; j += active) {
      for (uint i = 0; i < rows; ++i) {
        float v = src.at(i, j);
        part[i] += v * v;
      }
    }
  }
  float total[kLayerMaxRows];
  layer_row_sums(part, rows, red, nsg, sg, lane, total);
  for (uint i = 0; i < rows; ++i) {
    inv[i] = rsqrt(total[i] / float(width) + eps);
  }
}
