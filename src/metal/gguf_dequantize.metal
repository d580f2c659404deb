// GGUF blocks -> dense weights: one thread per 16-weight chunk of a row.
//   out[r, 16 c + j] = decode16(row r, chunk c)[j], j < 16, 16 c + j < cols
#include <metal_stdlib>
#include "gguf_blocks.h"
#include "gguf_dequantize_args.h"

using namespace metal;

template <typename Q, typename T>
kernel void gguf_dequantize(
    device const uchar* blocks [[buffer(0)]],
    device T* out [[buffer(1)]],
    constant GgufDequantizeArgs& args [[buffer(2)]],
    uint gid [[thread_position_in_grid]]) {
  ulong rows = args.rows;
  ulong total = rows * args.chunks;
  if (gid >= total) {
    return;
  }
  ulong r = gid / args.chunks;
  uint c = uint(gid % args.chunks);
  float v[16];
  Q::decode16(blocks + r * args.row_bytes, c, args.cols, v);
  device T* y = out + r * args.cols;
  for (uint j = 0; j < 16; ++j) {
    uint i = 16 * c + j;
    if (i < args.cols) {
      y[i] = T(v[j]);
    }
  }
}

#define instantiate_gguf_dequantize(tname, Q, dname, T)                              \
  template [[host_name("gguf_dequantize_" #tname "_" #dname)]] kernel decltype(      \
      gguf_dequantize<Q, T>) gguf_dequantize<Q, T>;

GGUF_FOR_EACH_FORMAT(instantiate_gguf_dequantize, float32, float)
GGUF_FOR_EACH_FORMAT(instantiate_gguf_dequantize, float16, half)
GGUF_FOR_EACH_FORMAT(instantiate_gguf_dequantize, bfloat16, bfloat)
