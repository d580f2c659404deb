#include "cpu/lora.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

size_t elt_size(Elt e) { return e == Elt::kF32 ? 4 : 2; }

// Dot product with 8 independent partial sums (vectorizable, fixed order).
__attribute__((always_inline)) inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}

// y += B h for one row, with bt = B transposed [R, out]: each output sums y, then r = 0, 1, ...
// in order; 64 outputs at a time stay in registers across the R products.
__attribute__((always_inline)) inline void expand(const float* bt, const float* h, int64_t rank,
                                                  int64_t od, float* y) {
  int64_t o0 = 0;
  for (; o0 + 64 <= od; o0 += 64) {
    float acc[64];
    for (int o = 0; o < 64; ++o) acc[o] = y[o0 + o];
    for (int64_t r = 0; r < rank; ++r) {
      const float hr = h[r];
      const float* br = bt + r * od + o0;
      for (int o = 0; o < 64; ++o) acc[o] += hr * br[o];
    }
    for (int o = 0; o < 64; ++o) y[o0 + o] = acc[o];
  }
  for (int64_t r = 0; r < rank; ++r) {
    for (int64_t o = o0; o < od; ++o) y[o] += h[r] * bt[r * od + o];
  }
}

// One row's delta: h = scale * A x, y += B h. Compiled twice: for any x86-64 and with
// AVX2 (8 lanes instead of 4; no FMA, so every sum rounds as in the plain build).
__attribute__((always_inline)) inline void row_delta(const float* a, const float* bt,
                                                     const float* x, float scale, int64_t in,
                                                     int64_t od, int64_t rank, float* h, float* y) {
  for (int64_t r = 0; r < rank; ++r) h[r] = scale * dot(a + r * in, x, in);
  expand(bt, h, rank, od, y);
}

void row_delta_plain(const float* a, const float* bt, const float* x, float scale, int64_t in,
                     int64_t od, int64_t rank, float* h, float* y) {
  row_delta(a, bt, x, scale, in, od, rank, h, y);
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void row_delta_avx2(const float* a, const float* bt,
                                                    const float* x, float scale, int64_t in,
                                                    int64_t od, int64_t rank, float* h, float* y) {
  row_delta(a, bt, x, scale, in, od, rank, h, y);
}
#endif

using RowDelta = void (*)(const float*, const float*, const float*, float, int64_t, int64_t,
                          int64_t, float*, float*);

RowDelta pick_row_delta() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2")) return row_delta_avx2;
#endif
  return row_delta_plain;
}

// One part's scratch, uninitialized (every value is written before it is read). Not
// thread_local: a thread_local here made every kernel of the library ~15 % slower
// (measured on decode steps without adapters).
struct Scratch {
  std::unique_ptr<float[]> buf;
  float *a, *bt, *tile, *x, *h, *y;
  Scratch(int64_t in, int64_t od, int64_t rank)
      : buf(new float[rank * in + rank * od + 64 * rank + in + rank + od]) {
    a = buf.get();
    bt = a + rank * in;
    tile = bt + rank * od;
    x = tile + 64 * rank;
    h = x + in;
    y = h + rank;
  }
};

#if defined(__x86_64__)
// B [out, 8] of elt E, 8 outputs at a time, transposed into bt [8, out] (an 8 x 8 register
// transpose per block); returns the outputs done (a multiple of 8). Exact: data movement only.
template <Elt E>
VLLM_METAL_AVX2 int64_t transpose_rank8_avx2(const void* b, int64_t od, float* bt) {
  const auto* src = static_cast<const typename EltTraits<E>::Storage*>(b);
  int64_t o = 0;
  for (; o + 8 <= od; o += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = load8<E>(src + (o + i) * 8);
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(bt + 0 * od + o, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(bt + 1 * od + o, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(bt + 2 * od + o, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(bt + 3 * od + o, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(bt + 4 * od + o, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(bt + 5 * od + o, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(bt + 6 * od + o, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(bt + 7 * od + o, _mm256_permute2f128_ps(u3, u7, 0x31));
  }
  return o;
}

int64_t transpose_rank8(Elt e, const void* b, int64_t od, float* bt) {
  if (!has_avx2_fma()) return 0;
  switch (e) {
    case Elt::kF32: return transpose_rank8_avx2<Elt::kF32>(b, od, bt);
    case Elt::kF16: return transpose_rank8_avx2<Elt::kF16>(b, od, bt);
    case Elt::kBF16: return transpose_rank8_avx2<Elt::kBF16>(b, od, bt);
  }
  return 0;
}
#else
int64_t transpose_rank8(Elt, const void*, int64_t, float*) { return 0; }
#endif

// Slot s's A as float [R, in] and B transposed to float [R, out] (so the expand step is
// R contiguous axpys per row); B is converted 64 outputs (64 * R contiguous values) at a
// time, or at rank 8 (--max-lora-rank 8) in 8 x 8 register blocks.
void convert_slot(const LoraApplyRows& p, int64_t s, Scratch& w) {
  const size_t es = elt_size(p.elt);
  const int64_t in = p.in_dim, od = p.out_dim, rank = p.rank;
  to_floats(p.elt, static_cast<const char*>(p.a) + s * rank * in * es, rank * in, w.a);
  const char* bs = static_cast<const char*>(p.b) + s * od * rank * es;
  const int64_t done = rank == 8 ? transpose_rank8(p.elt, bs, od, w.bt) : 0;
  for (int64_t o0 = done; o0 < od; o0 += 64) {
    const int64_t nb = std::min<int64_t>(64, od - o0);
    to_floats(p.elt, bs + o0 * rank * es, nb * rank, w.tile);
    for (int64_t o = 0; o < nb; ++o) {
      for (int64_t r = 0; r < rank; ++r) w.bt[r * od + o0 + o] = w.tile[o * rank + r];
    }
  }
}

}  // namespace

void lora_apply_rows(const LoraApplyRows& p) {
  const size_t es = elt_size(p.elt);
  const auto* y = static_cast<const char*>(p.y);
  const auto* x = static_cast<const char*>(p.x);
  auto* out = static_cast<char*>(p.out);
  const int64_t in = p.in_dim, od = p.out_dim, rank = p.rank;
  if (p.rows <= 0) return;
  static const RowDelta delta = pick_row_delta();

  // Rows in slot order (base rows first), split into a few contiguous parts run as one
  // pool job: each part converts the slots of its rows once. (A separate job converting
  // the slots, then one over the rows, doubled the pool hand-offs of a decode step.)
  std::vector<int64_t> order(p.rows);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t i, int64_t j) { return p.row_slot[i] < p.row_slot[j]; });
  const int64_t parts = std::min<int64_t>(p.rows, int64_t{num_threads()} * (p.rows >= 64 ? 4 : 1));
  parallel_for(parts, 1, [&](int64_t begin, int64_t end) {
    Scratch w(in, od, rank);
    const int64_t first = begin * p.rows / parts, last = end * p.rows / parts;
    int32_t converted = -1;
    for (int64_t k = first; k < last; ++k) {
      const int64_t t = order[k];
      const int32_t s = p.row_slot[t];
      const char* yr = y + t * od * es;
      char* outr = out + t * od * es;
      if (s < 0) {
        if (outr != yr) std::memcpy(outr, yr, od * es);  // out may be y itself
        continue;
      }
      if (s != converted) {
        convert_slot(p, s, w);
        converted = s;
      }
      to_floats(p.elt, x + t * in * es, in, w.x);
      to_floats(p.elt, yr, od, w.y);
      delta(w.a, w.bt, w.x, p.scale[s], in, od, rank, w.h, w.y);
      from_floats(p.elt, w.y, od, outr);
    }
  });
}

}  // namespace vllm_metal::cpu
