#include "cpu/layer_norm.h"

#include <algorithm>
#include <cmath>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

// h[i]: x[i], or x[i] + r[i] rounded to E (what a separate add would have stored).
template <Elt E>
inline float h_at(const S<E>* x, const S<E>* r, int64_t i) {
  const float v = EltTraits<E>::load(x + i);
  if (!r) return v;
  S<E> h;
  EltTraits<E>::store(&h, v + EltTraits<E>::load(r + i));
  return EltTraits<E>::load(&h);
}

template <Elt E>
void row_scalar(const S<E>* x, const S<E>* r, const S<E>* w, const S<E>* b, S<E>* y, int64_t n,
                float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += h_at<E>(x, r, i);
  const float mean = sum / static_cast<float>(n);
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float d = h_at<E>(x, r, i) - mean;
    ss += d * d;
  }
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    EltTraits<E>::store(y + i, (h_at<E>(x, r, i) - mean) * inv * EltTraits<E>::load(w + i) +
                                   EltTraits<E>::load(b + i));
  }
}

#if defined(__x86_64__)
// h[i .. i + 8)
template <Elt E>
VLLM_METAL_AVX2 inline __m256 h8(const S<E>* x, const S<E>* r, int64_t i) {
  const __m256 v = load8<E>(x + i);
  if (!r) return v;
  if constexpr (E == Elt::kF32) {
    return _mm256_add_ps(v, load8<E>(r + i));
  } else {
    S<E> h[8];  // round the sum to E, as the scalar path does
    store8<E>(h, _mm256_add_ps(v, load8<E>(r + i)));
    return load8<E>(h);
  }
}

template <Elt E>
VLLM_METAL_AVX2 void row_avx2(const S<E>* x, const S<E>* r, const S<E>* w, const S<E>* b, S<E>* y,
                              int64_t n, float eps) {
  if (n % 8 != 0) return row_scalar<E>(x, r, w, b, y, n, eps);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_add_ps(s0, h8<E>(x, r, i));
    s1 = _mm256_add_ps(s1, h8<E>(x, r, i + 8));
  }
  for (; i < n; i += 8) s0 = _mm256_add_ps(s0, h8<E>(x, r, i));
  const float mean = hsum8(_mm256_add_ps(s0, s1)) / static_cast<float>(n);
  const __m256 vm = _mm256_set1_ps(mean);
  s0 = _mm256_setzero_ps();
  s1 = _mm256_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m256 d0 = _mm256_sub_ps(h8<E>(x, r, i), vm);
    const __m256 d1 = _mm256_sub_ps(h8<E>(x, r, i + 8), vm);
    s0 = _mm256_fmadd_ps(d0, d0, s0);
    s1 = _mm256_fmadd_ps(d1, d1, s1);
  }
  for (; i < n; i += 8) {
    const __m256 d = _mm256_sub_ps(h8<E>(x, r, i), vm);
    s0 = _mm256_fmadd_ps(d, d, s0);
  }
  const float inv = 1.0f / std::sqrt(hsum8(_mm256_add_ps(s0, s1)) / static_cast<float>(n) + eps);
  const __m256 vi = _mm256_set1_ps(inv);
  for (i = 0; i < n; i += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(h8<E>(x, r, i), vm), vi);
    store8<E>(y + i, _mm256_fmadd_ps(z, load8<E>(w + i), load8<E>(b + i)));
  }
}
#endif

template <Elt E>
void run(const LayerNormRows& a) {
  auto* x = static_cast<const S<E>*>(a.x);
  auto* r = static_cast<const S<E>*>(a.residual);
  auto* w = static_cast<const S<E>*>(a.weight);
  auto* b = static_cast<const S<E>*>(a.bias);
  auto* y = static_cast<S<E>*>(a.out);
  auto row = &row_scalar<E>;
#if defined(__x86_64__)
  if (has_avx2_fma()) row = &row_avx2<E>;
#endif
  const int64_t n = a.hidden;
  // A fan-out costs ~6 us; below ~100k elements per chunk one thread is faster.
  const int64_t grain = std::max<int64_t>(1, 131072 / std::max<int64_t>(1, n));
  parallel_for(a.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      row(x + i * n, r ? r + i * n : nullptr, w, b, y + i * n, n, a.eps);
    }
  });
}

}  // namespace

void layer_norm_rows(const LayerNormRows& a) {
  if (a.rows == 0 || a.hidden == 0) return;
  switch (a.elt) {
    case Elt::kF32: return run<Elt::kF32>(a);
    case Elt::kF16: return run<Elt::kF16>(a);
    case Elt::kBF16: return run<Elt::kBF16>(a);
  }
}

}  // namespace vllm_metal::cpu
