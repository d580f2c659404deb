// Kernels with known counts, for the accounting tests (tests/test_mslemu_accounting.py).
#include <metal_stdlib>
using namespace metal;

// Every thread reads two neighbours: 2 loads per element in total, each byte read twice.
kernel void neighbours(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                       constant uint& n [[buffer(2)]], uint i [[thread_position_in_grid]]) {
    if (i < n) {
        y[i] = x[i] + x[(i + 1) % n];
    }
}

// One simdgroup: C = A * B for 8x8 float matrices from device memory.
kernel void matmul8(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                    device float* c [[buffer(2)]]) {
    simdgroup_float8x8 ma, mb;
    simdgroup_float8x8 mc = make_filled_simdgroup_matrix<float, 8>(0.0f);
    simdgroup_load(ma, a, 8);
    simdgroup_load(mb, b, 8);
    simdgroup_multiply_accumulate(mc, ma, mb, mc);
    simdgroup_store(mc, c, 8);
}

// Sum per threadgroup: one simd_sum and two barriers per thread, 32 floats of scratch.
kernel void tg_sum(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                   uint tid [[thread_position_in_threadgroup]], uint tg [[threadgroup_position_in_grid]],
                   uint ntg [[threads_per_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                   uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float partial[32];
    float s = simd_sum(x[tg * ntg + tid]);
    if (lane == 0) {
        partial[sg] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float t = 0.0f;
        for (uint i = 0; i < (ntg + 31) / 32; ++i) {
            t += partial[i];
        }
        out[tg] = t;
    }
    threadgroup_barrier(mem_flags::mem_none);
}

// One simdgroup sums n floats, lane l taking x[l], x[l + 32], ...: for n not a multiple
// of 32 the last pass leaves lanes idle (lane utilisation < 1).
kernel void strided_sum(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                        constant uint& n [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
    uint count = n;
    float s = 0.0f;
    for (uint i = lane; i < count; i += 32) {
        s += x[i];
    }
    s = simd_sum(s);
    if (lane == 0) {
        out[0] = s;
    }
}
