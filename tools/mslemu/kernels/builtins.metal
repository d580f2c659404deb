// The Metal builtins src/metal uses (and their simd / atomic neighbours), exercised so
// tests/test_mslemu_builtins.py can compare with answers from the Metal Shading Language
// specification's definitions.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint kSimdOps = 14;

// One row of kSimdOps results per thread; lanes with lane % 3 == 2 skip the divergent part.
kernel void simd_ops(device const float *in [[buffer(0)]], device float *out [[buffer(1)]],
                     uint t [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const float x = in[t];
  device float *o = out + t * kSimdOps;
  o[0] = simd_sum(x);
  o[1] = simd_max(x);
  o[2] = simd_min(x);
  o[3] = simd_prefix_inclusive_sum(x);
  o[4] = simd_prefix_exclusive_sum(x);
  o[5] = simd_shuffle(x, ushort((lane * 7u) % 32u));
  o[6] = simd_shuffle_down(x, ushort(3));
  o[7] = simd_shuffle_up(x, ushort(5));
  o[8] = simd_shuffle_xor(x, ushort(6));
  o[9] = simd_broadcast(x, ushort(17));
  o[10] = simd_shuffle_rotate_down(x, ushort(4));
  o[11] = simd_broadcast_first(x);
  if (lane % 3u != 2u) {
    o[12] = simd_sum(x);
    o[13] = simd_prefix_exclusive_sum(x);
  }
}

kernel void atomics(device atomic_int *a [[buffer(0)]], device atomic_uint *u [[buffer(1)]],
                    device int *old_add [[buffer(2)]], device int *cas [[buffer(3)]],
                    device uint *old_xchg [[buffer(4)]], uint i [[thread_position_in_grid]]) {
  old_add[i] = atomic_fetch_add_explicit(&a[0], int(i) + 1, memory_order_relaxed);
  atomic_fetch_max_explicit(&a[1], int((i * 37u) % 64u) - 20, memory_order_relaxed);
  atomic_fetch_min_explicit(&a[2], int((i * 37u) % 64u) - 20, memory_order_relaxed);
  atomic_fetch_sub_explicit(&a[4], 3, memory_order_relaxed);
  atomic_fetch_or_explicit(&u[0], 1u << (i % 32u), memory_order_relaxed);
  atomic_fetch_and_explicit(&u[1], ~(1u << (i % 32u)), memory_order_relaxed);
  atomic_fetch_xor_explicit(&u[2], i * 2654435761u, memory_order_relaxed);
  old_xchg[i] = atomic_exchange_explicit(&u[3], i + 100u, memory_order_relaxed);
  // exactly one thread swaps 0 -> i + 1; the others read the winner's value
  int expected = 0;
  bool won = false;
  while (!won && expected == 0)  // a weak exchange may fail spuriously
    won = atomic_compare_exchange_weak_explicit(&a[3], &expected, int(i) + 1, memory_order_relaxed,
                                                memory_order_relaxed);
  cas[i] = won ? -1 : expected;
  if (i == 0) atomic_store_explicit(&u[4], 4242u, memory_order_relaxed);
}

// Conversions and reinterpretations, one input per thread.
kernel void conversions(device const float *f [[buffer(0)]], device half *h [[buffer(1)]],
                        device bfloat *b [[buffer(2)]], device half *h_cast [[buffer(3)]],
                        device float *back [[buffer(4)]], device int *trunc_i [[buffer(5)]],
                        device const ushort *bits16 [[buffer(6)]], device float *from_bits16 [[buffer(7)]],
                        device const uint *bits32 [[buffer(8)]], device float *from_bits32 [[buffer(9)]],
                        device int *int_bits [[buffer(10)]], uint i [[thread_position_in_grid]]) {
  h[i] = half(f[i]);
  b[i] = bfloat(f[i]);
  h_cast[i] = (half)f[i];
  back[2 * i] = float(h[i]);
  back[2 * i + 1] = float(b[i]);
  trunc_i[i] = int(f[i]);
  from_bits16[i] = float(as_type<half>(bits16[i]));
  from_bits32[i] = as_type<float>(bits32[i]);
  int_bits[i] = as_type<int>(bits32[i]);
}

// Templated output conversion as the kernels write it: T(float).
template <typename T>
kernel void store_as(device const float *f [[buffer(0)]], device T *y [[buffer(1)]],
                     uint i [[thread_position_in_grid]]) {
  y[i] = T(f[i]);
}
template [[host_name("store_as_half")]] kernel decltype(store_as<half>) store_as<half>;
template [[host_name("store_as_bfloat")]] kernel decltype(store_as<bfloat>) store_as<bfloat>;

kernel void math_fns(device const float *x [[buffer(0)]], device float *o [[buffer(1)]],
                     uint i [[thread_position_in_grid]]) {
  const float v = x[i];
  device float *r = o + 10 * i;
  r[0] = rsqrt(v);
  r[1] = exp(v);
  r[2] = log(v);
  r[3] = sin(v);
  r[4] = cos(v);
  r[5] = precise::tanh(v);
  r[6] = sqrt(v);
  r[7] = ceil(v);
  r[8] = max(v, 2.5f);
  r[9] = min(v, 2.5f);
}

// simdgroup_matrix load / store / multiply on a 16 x 24 threadgroup tile (row-major).
kernel void matrix_ops(device const float *src [[buffer(0)]], device float *out [[buffer(1)]],
                       device float *region [[buffer(2)]], device float *region_t [[buffer(3)]],
                       uint t [[thread_index_in_threadgroup]]) {
  threadgroup float tile[16 * 24];
  threadgroup float stored[16 * 16];
  for (uint i = t; i < 16u * 24u; i += 32u) tile[i] = src[i];
  for (uint i = t; i < 16u * 16u; i += 32u) stored[i] = -1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 a, b, c, d, e;
  simdgroup_load(a, tile, 24);                                       // rows 0-7, columns 0-7
  simdgroup_load(b, tile, 24, ulong2(8, 4));                         // origin: column 8, row 4
  simdgroup_load(c, tile, 24, ulong2(0, 0), true);                   // the transpose of a
  simdgroup_load(d, tile + 8 * 24 + 16, 24, ulong2(0, 0), true);     // transposed block at row 8, column 16
  simdgroup_load(e, tile, 24, ulong2(16, 8), true);                  // transposed, origin column 16, row 8
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.5f);
  simdgroup_multiply_accumulate(acc, a, b, acc);
  simdgroup_float8x8 p;
  simdgroup_multiply(p, c, d);
  simdgroup_store(a, out, 8);
  simdgroup_store(b, out + 64, 8);
  simdgroup_store(c, out + 128, 8);
  simdgroup_store(d, out + 192, 8);
  simdgroup_store(e, out + 256, 8);
  simdgroup_store(acc, out + 320, 8);
  simdgroup_store(p, out + 384, 8);
  simdgroup_store(a, out + 448, 8, ulong2(0, 0), true);              // transposed store
  simdgroup_store(b, stored, 16, ulong2(8, 4));                      // origin: column 8, row 4
  simdgroup_store(b, region_t, 16, ulong2(3, 2), true);              // transposed, origin column 3, row 2
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = t; i < 16u * 16u; i += 32u) region[i] = stored[i];
}
