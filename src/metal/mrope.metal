// Multimodal rotary position embedding (Qwen2/2.5-VL, Qwen3-VL, Qwen3.5) over
// packed rows: like rope (NeoX pairs (i, i + rotary_dim/2), dimensions past
// rotary_dim copied), but pair i takes its angle from one of three position
// streams (temporal, height, width), positions[axis(i), token]:
//   sectioned (Qwen2-VL):    axis = 0 for i < s0, 1 for i < s0 + s1, else 2
//   interleaved (Qwen3-VL):  axis = 1 if i % 3 == 1 and i < 3 s1,
//                            2 if i % 3 == 2 and i < 3 s2, else 0
// Angles are reduced exactly with the turn table, as in rope.metal (the
// cos/sin helper below is the same computation).
#include <metal_stdlib>
#include "mrope_args.h"

using namespace metal;

constant constexpr float kRadPerUnit = 1.4629180792671596e-09f;  // 2 pi / 2^32
constant constexpr float kS3 = -1.0f / 6.0f;
constant constexpr float kS5 = 1.0f / 120.0f;
constant constexpr float kS7 = -1.0f / 5040.0f;
constant constexpr float kS9 = 1.0f / 362880.0f;
constant constexpr float kC2 = -1.0f / 2.0f;
constant constexpr float kC4 = 1.0f / 24.0f;
constant constexpr float kC6 = -1.0f / 720.0f;
constant constexpr float kC8 = 1.0f / 40320.0f;
constant constexpr float kC10 = -1.0f / 3628800.0f;

// (cos, sin) of position * 2 pi * rate; position = ph:pl, rate = gh:gl turns.
inline float2 mrope_cos_sin(uint pl, uint ph, uint gl, uint gh) {
  uint top = pl * gh + ph * gl + mulhi(pl, gl);
  uint q = (top + (1u << 29)) >> 30;
  int rem = as_type<int>(top - (q << 30));
  float r = float(rem) * kRadPerUnit;
  float r2 = r * r;
  float sp = r + r * r2 * (kS3 + r2 * (kS5 + r2 * (kS7 + r2 * kS9)));
  float cp = 1.0f + r2 * (kC2 + r2 * (kC4 + r2 * (kC6 + r2 * (kC8 + r2 * kC10))));
  float s = (q & 1u) ? cp : sp;
  float c = (q & 1u) ? sp : cp;
  if ((q & 2u) != 0u) {
    s = -s;
  }
  if (((q + 1u) & 2u) != 0u) {
    c = -c;
  }
  return float2(c, s);
}

inline uint mrope_axis(uint i, constant MropeArgs& args) {
  if (args.interleaved != 0u) {
    uint m = i % 3u;
    if (m == 1u && i < 3u * args.section1) {
      return 1u;
    }
    if (m == 2u && i < 3u * args.section2) {
      return 2u;
    }
    return 0u;
  }
  return i < args.section0 ? 0u : (i < args.section0 + args.section1 ? 1u : 2u);
}

template <typename T, typename P>
kernel void mrope(
    device const T* x [[buffer(0)]],
    device const P* positions [[buffer(1)]],
    device const uint* table [[buffer(2)]],
    device T* out [[buffer(3)]],
    constant MropeArgs& args [[buffer(4)]],
    uint token [[threadgroup_position_in_grid]],
    uint2 tid [[thread_position_in_threadgroup]],
    uint2 ntg [[threads_per_threadgroup]]) {
  const ulong row = ulong(token) * args.num_heads * args.head_size;
  device const T* xt = x + row;
  device T* ot = out + row;
  const uint npairs = args.rotary_half;
  for (uint i = tid.x; i < npairs; i += ntg.x) {
    long pos = long(positions[ulong(mrope_axis(i, args)) * args.num_tokens + token]);
    float2 cs = mrope_cos_sin(uint(pos), uint(pos >> 32), table[i], table[npairs + i]);
    for (uint h = tid.y; h < args.num_heads; h += ntg.y) {
      device const T* xh = xt + h * args.head_size;
      device T* oh = ot + h * args.head_size;
      float a = float(xh[i]);
      float b = float(xh[i + npairs]);
      oh[i] = T(a * cs.x - b * cs.y);
      oh[i + npairs] = T(b * cs.x + a * cs.y);
    }
  }
  for (uint j = 2u * npairs + tid.x; j < args.head_size; j += ntg.x) {
    for (uint h = tid.y; h < args.num_heads; h += ntg.y) {
      ot[h * args.head_size + j] = xt[h * args.head_size + j];
    }
  }
}

#define instantiate_mrope(tname, T, pname, P)                                          \
  template [[host_name("mrope_" #tname "_" #pname)]] kernel decltype(mrope<T, P>) \
      mrope<T, P>;

instantiate_mrope(float32, float, int32, int)
instantiate_mrope(float32, float, int64, long)
instantiate_mrope(float16, half, int32, int)
instantiate_mrope(float16, half, int64, long)
instantiate_mrope(bfloat16, bfloat, int32, int)
instantiate_mrope(bfloat16, bfloat, int64, long)
