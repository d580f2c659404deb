#include "cpu/rms_norm.h"

#include <algorithm>
#include <cmath>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

// h = x (+ r, rounded to E and stored); returns sum(h^2) over the row.
template <Elt E>
float sum_squares_scalar(const S<E>* x, const S<E>* r, S<E>* h, int64_t begin, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = begin; i < n; ++i) {
    float v = EltTraits<E>::load(x + i);
    if (r) {
      EltTraits<E>::store(h + i, v + EltTraits<E>::load(r + i));
      v = EltTraits<E>::load(h + i);
    }
    acc += v * v;
  }
  return acc;
}

template <Elt E>
void scale_scalar(const S<E>* src, const S<E>* w, S<E>* y, float inv, int64_t begin, int64_t n) {
  for (int64_t i = begin; i < n; ++i) {
    EltTraits<E>::store(y + i, EltTraits<E>::load(src + i) * inv * EltTraits<E>::load(w + i));
  }
}

template <Elt E>
void row_generic(const S<E>* x, const S<E>* r, const S<E>* w, S<E>* y, S<E>* h, int64_t n,
                 float eps) {
  float ss = sum_squares_scalar<E>(x, r, h, 0, n);
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  scale_scalar<E>(r ? h : x, w, y, inv, 0, n);
}

#if defined(__x86_64__)
template <Elt E>
VLLM_METAL_AVX2 void row_avx2(const S<E>* x, const S<E>* r, const S<E>* w, S<E>* y, S<E>* h,
                              int64_t n, float eps) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 a = load8<E>(x + i), b = load8<E>(x + i + 8);
    if (r) {
      // round the sum to E first: the norm must see what residual_out holds
      store8<E>(h + i, _mm256_add_ps(a, load8<E>(r + i)));
      store8<E>(h + i + 8, _mm256_add_ps(b, load8<E>(r + i + 8)));
      a = load8<E>(h + i);
      b = load8<E>(h + i + 8);
    }
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  float ss = hsum8(_mm256_add_ps(acc0, acc1)) + sum_squares_scalar<E>(x, r, h, i, n);
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const S<E>* src = r ? h : x;
  __m256 vinv = _mm256_set1_ps(inv);
  i = 0;
  for (; i + 8 <= n; i += 8) {
    store8<E>(y + i, _mm256_mul_ps(_mm256_mul_ps(load8<E>(src + i), vinv), load8<E>(w + i)));
  }
  scale_scalar<E>(src, w, y, inv, i, n);
}
#endif

#if defined(__aarch64__)
template <Elt E>
void row_neon(const S<E>* x, const S<E>* r, const S<E>* w, S<E>* y, S<E>* h, int64_t n,
              float eps) {
  float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    float32x4_t a = load4<E>(x + i), b = load4<E>(x + i + 4);
    if (r) {
      store4<E>(h + i, vaddq_f32(a, load4<E>(r + i)));
      store4<E>(h + i + 4, vaddq_f32(b, load4<E>(r + i + 4)));
      a = load4<E>(h + i);
      b = load4<E>(h + i + 4);
    }
    acc0 = vfmaq_f32(acc0, a, a);
    acc1 = vfmaq_f32(acc1, b, b);
  }
  float ss = vaddvq_f32(vaddq_f32(acc0, acc1)) + sum_squares_scalar<E>(x, r, h, i, n);
  float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const S<E>* src = r ? h : x;
  i = 0;
  for (; i + 4 <= n; i += 4) {
    store4<E>(y + i, vmulq_f32(vmulq_n_f32(load4<E>(src + i), inv), load4<E>(w + i)));
  }
  scale_scalar<E>(src, w, y, inv, i, n);
}
#endif

template <Elt E>
void run(const RmsNormRows& a) {
  auto* x = static_cast<const S<E>*>(a.x);
  auto* r = static_cast<const S<E>*>(a.residual);
  auto* w = static_cast<const S<E>*>(a.weight);
  auto* y = static_cast<S<E>*>(a.out);
  auto* h = static_cast<S<E>*>(a.residual_out);
  auto row = &row_generic<E>;
#if defined(__x86_64__)
  if (has_avx2_fma()) row = &row_avx2<E>;
#elif defined(__aarch64__)
  row = &row_neon<E>;
#endif
  const int64_t n = a.hidden;
  // A fan-out costs ~6 us; below ~100k elements per chunk one thread is faster.
  int64_t grain = std::max<int64_t>(1, 131072 / std::max<int64_t>(1, n));
  parallel_for(a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      row(x + i * a.x_row_stride, r ? r + i * a.residual_row_stride : nullptr, w, y + i * n,
          h ? h + i * n : nullptr, n, a.eps);
    }
  });
}

}  // namespace

void rms_norm_rows(const RmsNormRows& a) {
  switch (a.elt) {
    case Elt::kF32: return run<Elt::kF32>(a);
    case Elt::kF16: return run<Elt::kF16>(a);
    case Elt::kBF16: return run<Elt::kBF16>(a);
  }
}

}  // namespace vllm_metal::cpu
