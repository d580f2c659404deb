// A grammar's token bitmask applied to logits (ops/apply_token_bitmask.h):
//   out[r, t] = -inf        if row r has mask row m and bit t % 32 of bitmask[m, t / 32] is 0
//             = logits[r, t] otherwise
// Grid (spans, rows): each simdgroup owns a span of 32 mask words (1024 tokens) of
// one row. Lane i loads word i of the span (one coalesced 128-byte load), then 32
// steps: in step k every lane takes word k by simd_shuffle and handles token
// 32 k + i of the span, so the logits are read and written 32 consecutive
// elements at a time. The kernel moves bits only (B is the dtype's bits: uint for
// float32, ushort for float16/bfloat16; kNegInf is -inf's pattern), so fast math
// cannot touch a value. A disallowed token's logit is never read.
#include <metal_stdlib>
#include "apply_token_bitmask_args.h"

using namespace metal;

template <typename B, uint kNegInf>
kernel void apply_token_bitmask(
    device const B* logits [[buffer(0)]],
    device const uint* bitmask [[buffer(1)]],
    device const int* mask_of_row [[buffer(2)]],
    device B* out [[buffer(3)]],
    constant TokenBitmaskArgs& args [[buffer(4)]],
    uint2 tgp [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint nsg [[simdgroups_per_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint row = tgp.y;
  const int m = mask_of_row[row];
  const bool in_place = args.in_place != 0;
  const uint words = (args.vocab + 31) / 32;
  const uint w0 = (tgp.x * nsg + sg) * 32;  // first word of this simdgroup's span
  // all three exits are uniform over the simdgroup
  if ((m < 0 && in_place) || w0 >= words) {
    return;
  }
  device const B* x = logits + row * args.logits_row_stride;
  device B* y = out + row * args.out_row_stride;
  const uint steps = min(32u, words - w0);
  if (m < 0) {  // a row without a mask: copied
    for (uint k = 0; k < steps; ++k) {
      const uint t = (w0 + k) * 32 + lane;
      if (t < args.vocab) {
        y[t] = x[t];
      }
    }
    return;
  }
  device const uint* mrow = bitmask + uint(m) * args.mask_row_stride;
  const uint word = w0 + lane < words ? mrow[w0 + lane] : 0u;
  for (uint k = 0; k < steps; ++k) {
    const uint bits = simd_shuffle(word, ushort(k));
    const uint t = (w0 + k) * 32 + lane;
    const bool allowed = ((bits >> lane) & 1u) != 0;
    if (t < args.vocab) {
      if (!allowed) {
        y[t] = B(kNegInf);
      } else if (!in_place) {
        y[t] = x[t];
      }
    }
  }
}

template [[host_name("apply_token_bitmask_float32")]] kernel
    decltype(apply_token_bitmask<uint, 0xff800000u>) apply_token_bitmask<uint, 0xff800000u>;
template [[host_name("apply_token_bitmask_float16")]] kernel
    decltype(apply_token_bitmask<ushort, 0xfc00u>) apply_token_bitmask<ushort, 0xfc00u>;
template [[host_name("apply_token_bitmask_bfloat16")]] kernel
    decltype(apply_token_bitmask<ushort, 0xff80u>) apply_token_bitmask<ushort, 0xff80u>;
