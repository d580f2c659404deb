// Kernels that report what the emulator did: dispatch geometry, simd-group layout,
// function constants.  Used by tests/test_dispatch.py.
#include <metal_stdlib>
using namespace metal;

// Every thread counts itself in hits[] (row-major over the padded buffer) and records
// which threadgroup ran it and how large that threadgroup was.
kernel void grid_probe(
        device uint  * hits  [[buffer(0)]],   // [pad_h][pad_w]
        device uint4 * info  [[buffer(1)]],   // [pad_h][pad_w] (tgpig.x, tgpig.y, tptg.x, tptg.y)
        device uint4 * grid  [[buffer(2)]],   // [1] (threads_per_grid.xy, threadgroups_per_grid.xy)
        constant uint & pad_w [[buffer(3)]],
        uint2 gid   [[thread_position_in_grid]],
        uint2 tgpig [[threadgroup_position_in_grid]],
        uint2 tptg  [[threads_per_threadgroup]],
        uint2 tpg   [[threads_per_grid]],
        uint2 tgpg  [[threadgroups_per_grid]]) {
    const uint i = gid.y * pad_w + gid.x;
    hits[i] += 1;
    info[i] = uint4(tgpig.x, tgpig.y, tptg.x, tptg.y);
    if (gid.x == 0 && gid.y == 0) {
        grid[0] = uint4(tpg.x, tpg.y, tgpg.x, tgpg.y);
    }
}

// Simd-group layout of a 1-D threadgroup of any size, and a threadgroup sum built from
// simd_sum + threadgroup memory (the usual reduction shape).
kernel void simd_probe(
        device const float * x       [[buffer(0)]],   // [n_tg * ntg]
        device       uint4 * lanes   [[buffer(1)]],   // [n_tg * ntg] (simd_sum(1), prefix, sgitg, nsg)
        device       float * tg_sums [[buffer(2)]],   // [n_tg]
        uint gid   [[thread_position_in_grid]],
        uint tgid  [[threadgroup_position_in_grid]],
        uint tid   [[thread_index_in_threadgroup]],
        uint sgitg [[simdgroup_index_in_threadgroup]],
        uint tiisg [[thread_index_in_simdgroup]],
        uint nsg   [[simdgroups_per_threadgroup]]) {
    threadgroup float partial[32];
    const uint width  = simd_sum(1u);
    const uint prefix = simd_prefix_exclusive_sum(1u);
    lanes[gid] = uint4(width, prefix, sgitg, nsg);
    const float s = simd_sum(x[gid]);
    if (tiisg == 0) {
        partial[sgitg] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float t = 0.0f;
        for (uint k = 0; k < nsg; ++k) {
            t += partial[k];
        }
        tg_sums[tgid] = t;
    }
}

#define FC_BASE 10
constant bool  fc_has_bias [[function_constant(FC_BASE + 0)]];
constant uint  fc_act      [[function_constant(FC_BASE + 1)]];   // 0 identity, 1 relu, 2 square
constant float fc_gain     [[function_constant(FC_BASE + 2)]];

// y = act(gain * x + (has_bias ? bias : 0)); bias is only read when has_bias.
kernel void fc_affine(
        device const float * x    [[buffer(0)]],
        device const float * bias [[buffer(1)]],
        device       float * y    [[buffer(2)]],
        uint i [[thread_position_in_grid]]) {
    float v = fc_gain * x[i];
    if (fc_has_bias) {
        v += bias[i];
    }
    if (fc_act == 1) {
        v = max(v, 0.0f);
    } else if (fc_act == 2) {
        v = v * v;
    }
    y[i] = v;
}
