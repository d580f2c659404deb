// Kernels with the bugs a checked build (MSLEMU_CHECKS) must report, and their correct twins.
#include <metal_stdlib>
using namespace metal;

// Thread 0 sums what the others wrote: needs a threadgroup barrier with mem_threadgroup.
kernel void tg_sum(device const float *x [[buffer(0)]], device float *y [[buffer(1)]],
                   constant uint &mode [[buffer(2)]], uint t [[thread_index_in_threadgroup]],
                   uint n [[threads_per_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  threadgroup float part[64];
  part[t] = x[g * n + t];
  if (mode == 1) threadgroup_barrier(mem_flags::mem_threadgroup);
  if (mode == 2) threadgroup_barrier(mem_flags::mem_none);  // execution only: no memory order
  if (mode == 3) threadgroup_barrier(mem_flags::mem_device);
  if (t == 0) {
    float s = 0.0f;
    for (uint i = 0; i < n; ++i) s += part[i];
    y[g] = s;
  }
}

// Lanes of one simdgroup pass values through threadgroup memory.
kernel void simd_rotate(device float *y [[buffer(0)]], constant uint &mode [[buffer(1)]],
                        uint t [[thread_index_in_threadgroup]]) {
  threadgroup float v[32];
  v[t] = float(t);
  if (mode == 1) simdgroup_barrier(mem_flags::mem_threadgroup);
  if (mode == 2) simdgroup_barrier(mem_flags::mem_none);
  y[t] = v[(t + 1) % 32];
}

// Every thread also overwrites the previous thread's slot after a barrier: a write-after-read race.
kernel void tg_write_after_read(device float *y [[buffer(0)]], uint t [[thread_index_in_threadgroup]]) {
  threadgroup float v[64];
  v[t] = float(t);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float a = v[t];
  if (t > 0) v[t - 1] = a;
  y[t] = a;
}

kernel void shifted_copy(device const float *x [[buffer(0)]], device float *y [[buffer(1)]],
                         constant int &shift [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  y[i] = x[int(i) + shift];
}

kernel void shifted_store(device float *y [[buffer(0)]], constant int &shift [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  y[int(i) + shift] = 1.0f;
}

kernel void tg_overflow(device float *y [[buffer(0)]], uint t [[thread_index_in_threadgroup]]) {
  threadgroup float v[16];
  v[t] = 1.0f;  // launched with more than 16 threads
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[t] = v[t % 16];
}

kernel void dyn_tg_overflow(device float *y [[buffer(0)]], threadgroup float *v [[threadgroup(0)]],
                            uint t [[thread_index_in_threadgroup]]) {
  v[t] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[t] = v[t];
}

// All threads store to y[slot(i)].
kernel void scatter(device uint *y [[buffer(0)]], constant uint &modulo [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  y[i % modulo] = i;
}

// Order of arrival, through an atomic counter: differs between schedules, never a race.
kernel void arrival_order(device atomic_uint *counter [[buffer(0)]], device uint *order [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  uint k = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  order[k] = i;
}

// The missing-barrier read of tg_sum mode 0 without the race detector: a schedule-dependent sum.
kernel void tg_last_writer(device uint *y [[buffer(0)]], uint t [[thread_index_in_threadgroup]],
                           uint g [[threadgroup_position_in_grid]]) {
  threadgroup uint last;
  last = t;  // every thread: the value left depends on the order threads run
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (t == 0) y[g] = last;
}

// Two tickets per thread with a device read between (the read cannot move across the
// atomics): consecutive unless another thread runs between the two, as a preempted fiber
// does under MSLEMU_SCHEDULE in a checked build.
kernel void two_tickets(device atomic_uint *counter [[buffer(0)]], device uint *tickets [[buffer(1)]],
                        device const uint *ones [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  const uint k1 = atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  const uint step = ones[i];
  const uint k2 = atomic_fetch_add_explicit(counter, step, memory_order_relaxed);
  tickets[2 * i] = k1;
  tickets[2 * i + 1] = k2;
}
