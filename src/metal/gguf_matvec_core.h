// The mat-vec loop of the GGUF kernels, as device functions other kernels can call
// (a fused kernel runs the same loop, then applies its epilogue to the sums).
//
// A simdgroup owns `groups x rows_per_lane` weight rows. Its 32 lanes form `groups`
// contiguous groups of `lanes_per_row` lanes (a power of two dividing 32); lane i of a
// group walks the pieces i, i + lanes_per_row, ... of the group's rows, a piece being 16
// or 8 weights. The host picks the piece and lanes_per_row so that lanes_per_row divides
// the row's piece count: every lane walks as many pieces as its siblings, so none idles
// while they decode, at any k.
//
// Per piece a lane decodes its rows' weights once, then loads each x value once into a
// register and uses it for every one of its rows (up to kGgufMvMaxX x rows: one decode
// serves all of them). Sums: per (weight row, x row) a chain of fma over a piece's
// products, piece sums added in piece order, then a butterfly over the group's lanes.
// That order depends on k alone, never on m or on where an x row sits in its group of
// kGgufMvMaxX: batch-invariant mode runs this loop for every m.
#pragma once

#include <metal_stdlib>
#include "gguf_blocks.h"

using namespace metal;

constant constexpr uint kGgufMvMaxX = 8;        // x rows per weight decode
constant constexpr uint kGgufMvMaxRowsPerLane = 4;

// Where a lane sits: its rows [row0, row0 + rows) and its first piece.
struct GgufMvLane {
  uint row0;   // first weight row of the lane's group
  uint rows;   // rows of the group that exist (< rows_per_lane at the end of W)
  uint piece;  // the lane's first piece (its index in the group)
};

inline GgufMvLane gguf_mv_lane(uint sg_row0, uint n, uint lanes_per_row, uint rows_per_lane,
                               uint lane) {
  GgufMvLane l;
  l.row0 = sg_row0 + (lane / lanes_per_row) * rows_per_lane;
  l.rows = l.row0 < n ? min(rows_per_lane, n - l.row0) : 0;
  l.piece = lane % lanes_per_row;
  return l;
}

// Weight rows of format Q, `row_bytes` apart from `w` (the lane's first row).
template <typename Q>
struct GgufMvRowsOf {
  device const uchar* w;
  ulong row_bytes;
  uint k;
  void decode16(uint r, uint piece, thread float* v) const {
    Q::decode16(w + r * row_bytes, piece, k, v);
  }
  void decode8(uint r, uint piece, thread float* v) const {
    Q::decode8(w + r * row_bytes, piece, k, v);
  }
};

// decode16 / decode8 of the format with GGML type id `type`. The fused kernels pass a
// function constant, so Apple's compiler keeps one case per pipeline.
#define GGUF_MV_DECODE_CASES(N)                                         \
  switch (type) {                                                        \
    case 0: GgufF32::decode##N(row, piece, k, v); break;                 \
    case 1: GgufF16::decode##N(row, piece, k, v); break;                 \
    case 2: GgufQ4_0::decode##N(row, piece, k, v); break;                \
    case 3: GgufQ4_1::decode##N(row, piece, k, v); break;                \
    case 6: GgufQ5_0::decode##N(row, piece, k, v); break;                \
    case 7: GgufQ5_1::decode##N(row, piece, k, v); break;                \
    case 8: GgufQ8_0::decode##N(row, piece, k, v); break;                \
    case 10: GgufQ2_K::decode##N(row, piece, k, v); break;               \
    case 11: GgufQ3_K::decode##N(row, piece, k, v); break;               \
    case 12: GgufQ4_K::decode##N(row, piece, k, v); break;               \
    case 13: GgufQ5_K::decode##N(row, piece, k, v); break;               \
    case 14: GgufQ6_K::decode##N(row, piece, k, v); break;               \
    case 18: GgufIQ3_XXS::decode##N(row, piece, k, v); break;            \
    case 20: GgufIQ4_NL::decode##N(row, piece, k, v); break;             \
    case 21: GgufIQ3_S::decode##N(row, piece, k, v); break;              \
    case 23: GgufIQ4_XS::decode##N(row, piece, k, v); break;             \
    case 30: GgufBF16::decode##N(row, piece, k, v); break;               \
    case 39: GgufMXFP4::decode##N(row, piece, k, v); break;              \
    default:                                                             \
      for (uint j = 0; j < N; ++j) {                                     \
        v[j] = 0.0f; /* the planners only name supported types */       \
      }                                                                  \
      break;                                                             \
  }

inline void gguf_decode16_of(uint type, device const uchar* row, uint piece, uint k,
                             thread float* v) {
  GGUF_MV_DECODE_CASES(16)
}
inline void gguf_decode8_of(uint type, device const uchar* row, uint piece, uint k,
                            thread float* v) {
  GGUF_MV_DECODE_CASES(8)
}
#undef GGUF_MV_DECODE_CASES

// Weight rows of GGML type `type` (a runtime value; a function constant folds it).
struct GgufMvRowsTyped {
  uint type;
  device const uchar* w;
  ulong row_bytes;
  uint k;
  void decode16(uint r, uint piece, thread float* v) const {
    gguf_decode16_of(type, w + r * row_bytes, piece, k, v);
  }
  void decode8(uint r, uint piece, thread float* v) const {
    gguf_decode8_of(type, w + r * row_bytes, piece, k, v);
  }
};

// Two matrices' rows interleaved: lane row 2 r is a's row r, 2 r + 1 is b's (the fused
// gate and up projections: one x load serves both).
template <typename A, typename B>
struct GgufMvRowsPair {
  A a;
  B b;
  void decode16(uint r, uint piece, thread float* v) const {
    if (r & 1u) {
      b.decode16(r >> 1, piece, v);
    } else {
      a.decode16(r >> 1, piece, v);
    }
  }
  void decode8(uint r, uint piece, thread float* v) const {
    if (r & 1u) {
      b.decode8(r >> 1, piece, v);
    } else {
      a.decode8(r >> 1, piece, v);
    }
  }
};

// Dense rows of x in device memory, [xrows][stride].
template <typename T>
struct GgufMvX {
  device const T* x;
  ulong stride;
  float at(uint i, uint j) const { return float(x[i * stride + j]); }
};

// acc[r][i] += this lane's share of W row r . x row i, r < rows, i < xrows, walking the
// rows in pieces of P = 16 or 8 weights: pieces first, first + step, ... < pieces =
// ceil(k / P). W gives decode16 / decode8(r, piece, v); X gives x.at(i, j) as float.
template <uint P, typename W, typename X>
inline void gguf_mv_partial_of(thread const W& w, uint rows, thread const X& x, uint xrows,
                               uint k, uint pieces, uint first, uint step,
                               thread float (&acc)[kGgufMvMaxRowsPerLane][kGgufMvMaxX]) {
  for (uint c = first; c < pieces; c += step) {
    float v[kGgufMvMaxRowsPerLane][P];
    for (uint r = 0; r < rows; ++r) {
      if (P == 16) {
        w.decode16(r, c, v[r]);
      } else {
        w.decode8(r, c, v[r]);
      }
    }
    uint n_valid = min(P, k - P * c);
    for (uint i = 0; i < xrows; ++i) {
      float s[kGgufMvMaxRowsPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (uint j = 0; j < n_valid; ++j) {
        float xj = x.at(i, P * c + j);  // one load, used by every row of the lane
        for (uint r = 0; r < rows; ++r) {
          s[r] = fma(v[r][j], xj, s[r]);  // an explicit chain: fast math cannot reorder it
        }
      }
      for (uint r = 0; r < rows; ++r) {
        acc[r][i] += s[r];
      }
    }
  }
}

// The same with the piece size a runtime value (the host's shape.piece): 8 or 16.
template <typename W, typename X>
inline void gguf_mv_partial_any(uint piece, thread const W& w, uint rows, thread const X& x,
                                uint xrows, uint k, uint first, uint step,
                                thread float (&acc)[kGgufMvMaxRowsPerLane][kGgufMvMaxX]) {
  if (piece == 8) {
    gguf_mv_partial_of<8>(w, rows, x, xrows, k, (k + 7) / 8, first, step, acc);
  } else {
    gguf_mv_partial_of<16>(w, rows, x, xrows, k, (k + 15) / 16, first, step, acc);
  }
}

// gguf_matvec's form: the lane's rows of W (format Q) over dense x rows.
template <typename Q, typename T, uint P>
inline void gguf_mv_partial(device const uchar* w, ulong w_row_bytes, device const T* x,
                            ulong x_row_stride, uint xrows, uint k, uint pieces, uint step,
                            GgufMvLane l, thread float (&acc)[kGgufMvMaxRowsPerLane][kGgufMvMaxX]) {
  GgufMvRowsOf<Q> wr;
  wr.w = w + ulong(l.row0) * w_row_bytes;
  wr.row_bytes = w_row_bytes;
  wr.k = k;
  GgufMvX<T> xs;
  xs.x = x;
  xs.stride = x_row_stride;
  gguf_mv_partial_of<P>(wr, l.rows, xs, xrows, k, pieces, l.piece, step, acc);
}

inline void gguf_mv_clear(thread float (&acc)[kGgufMvMaxRowsPerLane][kGgufMvMaxX]) {
  for (uint r = 0; r < kGgufMvMaxRowsPerLane; ++r) {
    for (uint i = 0; i < kGgufMvMaxX; ++i) {
      acc[r][i] = 0.0f;
    }
  }
}

// Sums acc over the lanes of each group (xor butterfly inside the aligned group: every
// lane ends with the same total). All 32 lanes must call it with the same arguments.
inline void gguf_mv_reduce(thread float (&acc)[kGgufMvMaxRowsPerLane][kGgufMvMaxX],
                           uint rows_per_lane, uint xrows, uint lanes_per_row) {
  for (uint d = 1; d < lanes_per_row; d <<= 1) {
    for (uint r = 0; r < rows_per_lane; ++r) {
      for (uint i = 0; i < xrows; ++i) {
        acc[r][i] += simd_shuffle_xor(acc[r][i], ushort(d));
      }
    }
  }
}
