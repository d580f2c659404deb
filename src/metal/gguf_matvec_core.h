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

// acc[r][i] += this lane's share of W[l.row0 + r] . x[i], i < xrows, walking the row in
// pieces of P = 16 or 8 weights (pieces: ceil(k / P); l.piece and step count pieces).
template <typename Q, typename T, uint P>
inline void gguf_mv_partial(device const uchar* w, ulong w_row_bytes, device const T* x,
                            ulong x_row_stride, uint xrows, uint k, uint pieces, uint step,
                            GgufMvLane l, thread float (&acc)[kGgufMvMaxRowsPerLane][kGgufMvMaxX]) {
  device const uchar* wr = w + ulong(l.row0) * w_row_bytes;
  for (uint c = l.piece; c < pieces; c += step) {
    float v[kGgufMvMaxRowsPerLane][P];
    for (uint r = 0; r < l.rows; ++r) {
      if (P == 16) {
        Q::decode16(wr + r * w_row_bytes, c, k, v[r]);
      } else {
        Q::decode8(wr + r * w_row_bytes, c, k, v[r]);
      }
    }
    uint n_valid = min(P, k - P * c);
    for (uint i = 0; i < xrows; ++i) {
      device const T* xr = x + i * x_row_stride + P * c;
      float s[kGgufMvMaxRowsPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (uint j = 0; j < n_valid; ++j) {
        float xj = float(xr[j]);  // one load, used by every row of the lane
        for (uint r = 0; r < l.rows; ++r) {
          s[r] = fma(v[r][j], xj, s[r]);  // an explicit chain: fast math cannot reorder it
        }
      }
      for (uint r = 0; r < l.rows; ++r) {
        acc[r][i] += s[r];
      }
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
