// Deliberately broken kernels: the emulator must expose these bugs.
#include <metal_stdlib>
using namespace metal;

// BUG: no threadgroup_barrier between publishing per-simdgroup maxima and reading them.
kernel void rowmax_missing_barrier(
        device const float * src [[buffer(0)]],
        device       float * dst [[buffer(1)]],
        constant     uint  & n   [[buffer(2)]],
        uint   row   [[threadgroup_position_in_grid]],
        uint   tid   [[thread_position_in_threadgroup]],
        uint   ntg   [[threads_per_threadgroup]],
        ushort sgitg [[simdgroup_index_in_threadgroup]],
        ushort tiisg [[thread_index_in_simdgroup]]) {
    threadgroup float partial[32];
    float m = -INFINITY;
    for (uint i = tid; i < n; i += ntg) m = max(m, src[row*n + i]);
    m = simd_max(m);
    if (tiisg == 0) partial[sgitg] = m;
    // threadgroup_barrier(mem_flags::mem_threadgroup);   <-- missing
    if (tid == 0) {
        float r = partial[0];
        for (uint k = 1; k < ntg/32; ++k) r = max(r, partial[k]);
        dst[row] = r;
    }
}

// UB in Metal: some threads return before a threadgroup_barrier the others wait at.
kernel void barrier_after_return(
        device float * dst [[buffer(0)]],
        uint tid [[thread_position_in_grid]]) {
    if (tid % 2) return;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    dst[tid] = 1.0f;
}

// Vector conversion semantics: MSL (half4)f4 converts values (clang would bitcast).
kernel void cast_semantics(
        device const float4 * src [[buffer(0)]],
        device       half4  * dst [[buffer(1)]],
        device       int4   * dsti [[buffer(2)]],
        uint i [[thread_position_in_grid]]) {
    dst[i]  = (half4) src[i];
    dsti[i] = (int4) src[i] * 2;
}

// BUG: thread 0 sums all 32 slots of partial[], but only ceil(ntg / 32) simdgroups wrote
// theirs.  Stale threadgroup memory is often zero, so the result looks right;
// MSLEMU_POISON=1 fills threadgroup memory with NaN at every threadgroup start.
kernel void sum_reads_unwritten_tg(
        device const float * x   [[buffer(0)]],
        device       float * dst [[buffer(1)]],
        uint tgid  [[threadgroup_position_in_grid]],
        uint tid   [[thread_index_in_threadgroup]],
        uint ntg   [[threads_per_threadgroup]],
        uint sgitg [[simdgroup_index_in_threadgroup]],
        uint tiisg [[thread_index_in_simdgroup]]) {
    threadgroup float partial[32];
    const float s = simd_sum(x[tgid * ntg + tid]);
    if (tiisg == 0) {
        partial[sgitg] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
        float t = 0.0f;
        for (uint k = 0; k < 32; ++k) {
            t += partial[k];
        }
        dst[tgid] = t;
    }
}

// UB in Metal: the two halves of the threadgroup wait at different barriers.
kernel void divergent_barrier(
        device float * dst [[buffer(0)]],
        uint tid [[thread_index_in_threadgroup]],
        uint gid [[thread_position_in_grid]],
        uint ntg [[threads_per_threadgroup]]) {
    threadgroup float t[1024];
    t[tid] = float(tid);
    if (tid < ntg / 2) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    } else {
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    dst[gid] = t[(tid + 1) % ntg];
}

// 64 KiB of threadgroup memory, over the 32 KiB Apple GPUs allow: fails on a Mac.
// The emulator has room for it and says so only under MSLEMU_STRICT=1.
kernel void threadgroup_memory_too_large(
        device float * dst [[buffer(0)]],
        uint tid [[thread_index_in_threadgroup]]) {
    threadgroup float big[16384];
    big[tid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    dst[tid] = big[tid];
}
