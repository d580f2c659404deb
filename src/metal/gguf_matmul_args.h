// Arguments of the gguf_matvec / gguf_matmul kernels, shared by the host (C++)
// and the shader. y[m, n] = x[m, k] @ W[n, k]^T with W in GGUF block form.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstdint>
#endif

struct GgufMatmulArgs {
  int64_t x_row_stride;  // elements between rows of x
  int64_t y_row_stride;  // elements between rows of y
  uint64_t w_row_bytes;  // bytes of one encoded weight row
  uint32_t m;            // rows of x (the mat-vec kernel takes them 8 per grid row)
  uint32_t n;            // weight rows = outputs per x row
  uint32_t k;            // weights per row
  uint32_t chunks;       // 16-weight chunks per weight row: ceil(k / 16)
  uint32_t lanes_per_row;  // mat-vec: lanes sharing a weight row (divides 32 and the pieces)
  uint32_t rows_per_lane;  // mat-vec: weight rows each lane decodes (<= 4)
  uint32_t piece;          // mat-vec: weights per piece a lane decodes at once (16 or 8)
  uint32_t epilogue;       // bit 0: add bias (buffer 4); bits 1-2: 0 none, 1 GELU (erf), 2 GELU (tanh)
};

#ifndef __METAL_VERSION__
static_assert(sizeof(GgufMatmulArgs) == 56, "GgufMatmulArgs layout must match the shader");
static_assert(offsetof(GgufMatmulArgs, m) == 24, "GgufMatmulArgs layout must match the shader");
static_assert(offsetof(GgufMatmulArgs, chunks) == 36, "GgufMatmulArgs layout must match the shader");
static_assert(offsetof(GgufMatmulArgs, piece) == 48, "GgufMatmulArgs layout must match the shader");
#endif
