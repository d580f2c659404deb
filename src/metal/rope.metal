// Rotary position embedding over packed rows (one position per token).
//
//   out[t, h, i1] = x1 * cos - x2 * sin,  out[t, h, i2] = x2 * cos + x1 * sin
//   with (i1, i2) = (i, i + rotary_dim/2) (NeoX) or (2i, 2i + 1) (GPT-J), the
//   angle positions[t] * inv_freq[i], cos/sin times mscale; dimensions past
//   rotary_dim are copied.
//
// One threadgroup per token: x threads walk the pairs (each computes its cos/sin
// once), y threads walk the heads. Angles are exact modulo one turn: the table
// holds each pair's turns per position as a 64-bit fraction (two 32-bit words,
// low words first); position * rate mod 2^64 is integer arithmetic, and only the
// remainder after the nearest quarter turn becomes a float (|r| <= pi/4), so
// fast math cannot spoil it and large positions keep full precision. The CPU
// kernel (src/cpp/cpu/rope.cpp) computes the same values the same way.
#include <metal_stdlib>
#include "rope_args.h"
#include "rope_turns.h"

using namespace metal;

template <typename T, typename P, bool NEOX>
kernel void rope(
    device const T* x [[buffer(0)]],
    device const P* positions [[buffer(1)]],
    device const uint* table [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant RopeArgs& args [[buffer(4)]],
    uint token [[threadgroup_position_in_grid]],
    uint2 tid [[thread_position_in_threadgroup]],
    uint2 ntg [[threads_per_threadgroup]]) {
  long pos = long(positions[token]);  // int32 sign-extends
  uint pl = uint(pos);
  uint ph = uint(pos >> 32);
  device const T* xt = x + token * args.x_token_stride;
  device T* ot = out + token * args.out_token_stride;
  uint npairs = args.rotary_half;
  for (uint i = tid.x; i < npairs; i += ntg.x) {
    float2 cs = rope_cos_sin(pl, ph, table[i], table[npairs + i], args.mscale);
    uint i1 = NEOX ? i : 2u * i;
    uint i2 = NEOX ? i + npairs : 2u * i + 1u;
    for (uint h = tid.y; h < args.num_heads; h += ntg.y) {
      device const T* xh = xt + h * args.x_head_stride;
      device T* oh = ot + h * args.head_size;
      float a = float(xh[i1 * args.x_dim_stride]);
      float b = float(xh[i2 * args.x_dim_stride]);
      oh[i1] = T(a * cs.x - b * cs.y);
      oh[i2] = T(b * cs.x + a * cs.y);
    }
  }
  // dimensions past rotary_dim pass through (partial rotary)
  for (uint j = 2u * npairs + tid.x; j < args.head_size; j += ntg.x) {
    for (uint h = tid.y; h < args.num_heads; h += ntg.y) {
      ot[h * args.head_size + j] = xt[h * args.x_head_stride + j * args.x_dim_stride];
    }
  }
}

#define instantiate_rope(pair, neox, tname, T, pname, P)                        \
  template [[host_name("rope_" #pair "_" #tname "_" #pname)]] kernel decltype( \
      rope<T, P, neox>) rope<T, P, neox>;

#define instantiate_rope_positions(pair, neox, tname, T) \
  instantiate_rope(pair, neox, tname, T, int32, int)     \
  instantiate_rope(pair, neox, tname, T, int64, long)

#define instantiate_rope_pairs(tname, T)            \
  instantiate_rope_positions(neox, true, tname, T) \
  instantiate_rope_positions(gptj, false, tname, T)

instantiate_rope_pairs(float32, float)
instantiate_rope_pairs(float16, half)
instantiate_rope_pairs(bfloat16, bfloat)
