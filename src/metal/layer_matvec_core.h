// The mat-vec inner loop of the fused decoder-layer kernels (decoder_layer.metal),
// kept apart so a faster core (more rows per simdgroup, x in registers) can
// replace it without touching the kernels around it. MSL only.
//
// One simdgroup computes one weight row for up to kLayerMaxRows activation rows:
// lane l decodes the row's 16-weight chunks l, l + 32, ... once each and dots
// each chunk with every activation row (an explicit fma chain, which fast math
// does not reorder), adding the chunk sums in chunk order. That is the order of
// gguf_matvec (gguf_matmul.metal), so a row's sum does not depend on the batch
// and the fused kernels give gguf_matvec's bits.
#pragma once

#include <metal_stdlib>
#include "gguf_blocks.h"

using namespace metal;

constant constexpr uint kLayerMaxRows = 8;

// decode16 of the format with GGML type id `type` (a function constant at the
// call sites, so Apple's compiler keeps one case per pipeline).
inline void gguf_decode16_of(uint type, device const uchar* row, uint chunk, uint k,
                             thread float* v) {
  switch (type) {
    case 0: GgufF32::decode16(row, chunk, k, v); break;
    case 1: GgufF16::decode16(row, chunk, k, v); break;
    case 2: GgufQ4_0::decode16(row, chunk, k, v); break;
    case 3: GgufQ4_1::decode16(row, chunk, k, v); break;
    case 6: GgufQ5_0::decode16(row, chunk, k, v); break;
    case 7: GgufQ5_1::decode16(row, chunk, k, v); break;
    case 8: GgufQ8_0::decode16(row, chunk, k, v); break;
    case 10: GgufQ2_K::decode16(row, chunk, k, v); break;
    case 11: GgufQ3_K::decode16(row, chunk, k, v); break;
    case 12: GgufQ4_K::decode16(row, chunk, k, v); break;
    case 13: GgufQ5_K::decode16(row, chunk, k, v); break;
    case 14: GgufQ6_K::decode16(row, chunk, k, v); break;
    case 18: GgufIQ3_XXS::decode16(row, chunk, k, v); break;
    case 20: GgufIQ4_NL::decode16(row, chunk, k, v); break;
    case 21: GgufIQ3_S::decode16(row, chunk, k, v); break;
    case 23: GgufIQ4_XS::decode16(row, chunk, k, v); break;
    case 30: GgufBF16::decode16(row, chunk, k, v); break;
    default:
      for (uint j = 0; j < 16; ++j) {
        v[j] = 0.0f;  // the planner only names supported types
      }
      break;
  }
}

// acc[i] += row `wr` . x row i, over this lane's chunks; the caller simd_sums acc.
// X gives the activations as float: x.at(i, j) for row i < rows, column j < k.
template <typename X>
inline void layer_matvec_row(uint type, device const uchar* wr, uint k, uint chunks,
                             thread const X& x, uint rows, uint lane, thread float* acc) {
  for (uint c = lane; c < chunks; c += 32) {
    float v[16];
    gguf_decode16_of(type, wr, c, k, v);
    uint n_valid = min(16u, k - 16 * c);
    for (uint i = 0; i < rows; ++i) {
      float s = 0.0f;
      for (uint j = 0; j < n_valid; ++j) {
        s = fma(v[j], x.at(i, 16 * c + j), s);
      }
      acc[i] += s;
    }
  }
}

// Two weight rows (gate and up) over the same x: each x value is read once for both;
// each row's sums are those of layer_matvec_row (same chunks, same order).
template <typename X>
inline void layer_matvec_row2(uint type0, device const uchar* w0, uint type1,
                              device const uchar* w1, uint k, uint chunks, thread const X& x,
                              uint rows, uint lane, thread float* acc0, thread float* acc1) {
  for (uint c = lane; c < chunks; c += 32) {
    float v0[16];
    float v1[16];
    gguf_decode16_of(type0, w0, c, k, v0);
    gguf_decode16_of(type1, w1, c, k, v1);
    uint n_valid = min(16u, k - 16 * c);
    for (uint i = 0; i < rows; ++i) {
      float s0 = 0.0f;
      float s1 = 0.0f;
      for (uint j = 0; j < n_valid; ++j) {
        float xv = x.at(i, 16 * c + j);
        s0 = fma(v0[j], xv, s0);
        s1 = fma(v1[j], xv, s1);
      }
      acc0[i] += s0;
      acc1[i] += s1;
    }
  }
}
