// y[m, n] = x[m, k] @ W[n, k]^T with W in GGUF block form.
//
// gguf_matvec (decode rows): the loop of gguf_matvec_core.h. Each simdgroup owns
// 32 / lanes_per_row x rows_per_lane weight rows (the host picks both and the piece size
// from k, so every lane walks as many pieces as its siblings); 2 simdgroups per
// threadgroup; grid y walks
// groups of 8 x rows, each weight piece decoded once for all of them. The sum order of
// an x row depends on k alone, so batch-invariant mode runs this kernel for every m.
//
// gguf_matmul (prefill): 32 x 32 output tile per threadgroup of 4 simdgroups
// (each a 16 x 16 quarter = 2 x 2 simdgroup 8x8 float matrices). Per 32-wide
// k step, x and the decoded weights are staged in threadgroup memory as
// float32; out-of-range rows and columns are zero-filled, stores are guarded.
//
// Both apply the epilogue (args.epilogue) to the float32 sums before the one rounding to
// T: + bias[col] (buffer 4), then GELU (gelu_core.h), as the CPU kernel does.
#include <metal_stdlib>
#include "gguf_blocks.h"
#include "gguf_matvec_core.h"
#include "gguf_matmul_args.h"
#include "gelu_core.h"

using namespace metal;

constant constexpr uint kMatvecSimdgroups = 2;
constant constexpr uint kTile = 32;

template <typename T>
inline float gguf_epilogue(float v, device const T* bias, uint col, uint flags) {
  if ((flags & 1u) != 0u) {
    v += float(bias[col]);
  }
  const uint act = flags >> 1;
  return act == 1u ? gelu_erf(v) : act == 2u ? gelu_tanh(v) : v;
}

template <typename Q, typename T>
kernel void gguf_matvec(
    device const uchar* w [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device T* y [[buffer(2)]],
    constant GgufMatmulArgs& args [[buffer(3)]],
    device const T* bias [[buffer(4)]],
    uint2 tgp [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint lanes_per_row = args.lanes_per_row;
  const uint rows_per_lane = args.rows_per_lane;
  uint sg_row0 = (tgp.x * kMatvecSimdgroups + sg) * (32 / lanes_per_row) * rows_per_lane;
  uint x0 = tgp.y * kGgufMvMaxX;  // first x row of this group
  if (sg_row0 >= args.n || x0 >= args.m) {
    return;  // whole simdgroup; no barriers in this kernel
  }
  uint xrows = min(kGgufMvMaxX, args.m - x0);
  x += ulong(x0) * args.x_row_stride;
  y += ulong(x0) * args.y_row_stride;
  GgufMvLane l = gguf_mv_lane(sg_row0, args.n, lanes_per_row, rows_per_lane, lane);
  float acc[kGgufMvMaxRowsPerLane][kGgufMvMaxX];
  gguf_mv_clear(acc);
  if (args.piece == 8) {
    gguf_mv_partial<Q, T, 8>(w, args.w_row_bytes, x, args.x_row_stride, xrows, args.k,
                             (args.k + 7) / 8, lanes_per_row, l, acc);
  } else {
    gguf_mv_partial<Q, T, 16>(w, args.w_row_bytes, x, args.x_row_stride, xrows, args.k,
                              args.chunks, lanes_per_row, l, acc);
  }
  gguf_mv_reduce(acc, rows_per_lane, xrows, lanes_per_row);
  if (l.piece == 0) {  // one lane of each group stores its rows
    for (uint r = 0; r < l.rows; ++r) {
      for (uint i = 0; i < xrows; ++i) {
        y[i * args.y_row_stride + l.row0 + r] =
            T(gguf_epilogue(acc[r][i], bias, l.row0 + r, args.epilogue));
      }
    }
  }
}

template <typename Q, typename T>
kernel void gguf_matmul(
    device const uchar* w [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device T* y [[buffer(2)]],
    constant GgufMatmulArgs& args [[buffer(3)]],
    device const T* bias [[buffer(4)]],
    uint2 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float xs[kTile * kTile];  // [m][k] of the step
  threadgroup float ws[kTile * kTile];  // [n][k] of the step
  threadgroup float ys[kTile * kTile];  // [m][n] result
  uint m0 = tgp.y * kTile;
  uint n0 = tgp.x * kTile;
  uint sm = (sg / 2) * 16;
  uint sn = (sg % 2) * 16;
  simdgroup_float8x8 acc[2][2];
  for (uint i = 0; i < 2; ++i) {
    for (uint j = 0; j < 2; ++j) {
      acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  for (uint k0 = 0; k0 < args.k; k0 += kTile) {
    for (uint e = tid; e < kTile * kTile; e += 128) {
      uint r = e / kTile;
      uint c = e % kTile;
      bool inside = m0 + r < args.m && k0 + c < args.k;
      xs[e] = inside ? float(x[ulong(m0 + r) * args.x_row_stride + k0 + c]) : 0.0f;
    }
    if (tid < 2 * kTile) {
      uint r = tid / 2;
      uint chunk = k0 / 16 + tid % 2;
      float v[16];
      if (n0 + r < args.n && chunk < args.chunks) {
        Q::decode16(w + ulong(n0 + r) * args.w_row_bytes, chunk, args.k, v);
      } else {
        for (uint j = 0; j < 16; ++j) {
          v[j] = 0.0f;
        }
      }
      for (uint j = 0; j < 16; ++j) {
        ws[r * kTile + 16 * (tid % 2) + j] = v[j];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < kTile; kk += 8) {
      simdgroup_float8x8 a[2];
      simdgroup_float8x8 b[2];
      for (uint i = 0; i < 2; ++i) {
        simdgroup_load(a[i], xs, kTile, ulong2(kk, sm + 8 * i));
        simdgroup_load(b[i], ws, kTile, ulong2(kk, sn + 8 * i), true);
      }
      for (uint i = 0; i < 2; ++i) {
        for (uint j = 0; j < 2; ++j) {
          simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 2; ++i) {
    for (uint j = 0; j < 2; ++j) {
      simdgroup_store(acc[i][j], ys, kTile, ulong2(sn + 8 * j, sm + 8 * i));
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < kTile * kTile; e += 128) {
    uint r = e / kTile;
    uint c = e % kTile;
    if (m0 + r < args.m && n0 + c < args.n) {
      y[ulong(m0 + r) * args.y_row_stride + n0 + c] =
          T(gguf_epilogue(ys[e], bias, n0 + c, args.epilogue));
    }
  }
}

#define instantiate_gguf_matmul(tname, Q, dname, T)                                          \
  template [[host_name("gguf_matvec_" #tname "_" #dname)]] kernel decltype(gguf_matvec<Q, T>) \
      gguf_matvec<Q, T>;                                                                      \
  template [[host_name("gguf_matmul_" #tname "_" #dname)]] kernel decltype(gguf_matmul<Q, T>) \
      gguf_matmul<Q, T>;

GGUF_FOR_EACH_FORMAT(instantiate_gguf_matmul, float32, float)
GGUF_FOR_EACH_FORMAT(instantiate_gguf_matmul, float16, half)
GGUF_FOR_EACH_FORMAT(instantiate_gguf_matmul, bfloat16, bfloat)
