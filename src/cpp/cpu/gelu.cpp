#include "cpu/gelu.h"

#include <algorithm>
#include <cmath>

#include "cpu/parallel.h"
#include "cpu/vec_exp.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

constexpr float kRsqrt2 = 0.70710678118654752f;
constexpr float kP = 0.3275911f;
constexpr float kA[5] = {0.254829592f, -0.284496736f, 1.421413741f, -1.453152027f,
                         1.061405429f};
constexpr float kTanhC = 1.5957691216057308f;  // 2 sqrt(2 / pi)

inline float gelu_erf(float x) {
  const float z = std::fabs(x) * kRsqrt2;
  const float t = 1.0f / (1.0f + kP * z);
  const float poly = t * (kA[0] + t * (kA[1] + t * (kA[2] + t * (kA[3] + t * kA[4]))));
  const float q = 0.5f * poly * std::exp(-z * z);
  return x * (x >= 0.0f ? 1.0f - q : q);
}

inline float gelu_tanh(float x) {
  const float z = -kTanhC * (x + 0.044715f * x * x * x);
  return x / (1.0f + std::exp(std::min(z, 88.0f)));
}

template <Elt E>
void span_scalar(const S<E>* x, S<E>* y, int64_t begin, int64_t end, bool approximate) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = EltTraits<E>::load(x + i);
    EltTraits<E>::store(y + i, approximate ? gelu_tanh(v) : gelu_erf(v));
  }
}

#if defined(__x86_64__)
template <Elt E>
VLLM_METAL_AVX2 void span_avx2(const S<E>* x, S<E>* y, int64_t begin, int64_t end,
                               bool approximate) {
  const __m256 one = _mm256_set1_ps(1.0f), half = _mm256_set1_ps(0.5f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = load8<E>(x + i);
    __m256 r;
    if (approximate) {
      const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), v),
                                           _mm256_mul_ps(v, v), v);
      r = _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_mul_ps(_mm256_set1_ps(-kTanhC), inner))));
    } else {
      const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(sign, v), _mm256_set1_ps(kRsqrt2));
      const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(kP), z, one));
      __m256 p = _mm256_set1_ps(kA[4]);
      p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kA[3]));
      p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kA[2]));
      p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kA[1]));
      p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kA[0]));
      p = _mm256_mul_ps(p, t);
      const __m256 q = _mm256_mul_ps(_mm256_mul_ps(half, p),
                                     exp8(_mm256_xor_ps(sign, _mm256_mul_ps(z, z))));
      const __m256 nonneg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ);
      r = _mm256_mul_ps(v, _mm256_blendv_ps(q, _mm256_sub_ps(one, q), nonneg));
    }
    store8<E>(y + i, r);
  }
  span_scalar<E>(x, y, i, end, approximate);
}
#endif

template <Elt E>
void run(const void* xv, void* yv, int64_t count, bool approximate) {
  const auto* x = static_cast<const S<E>*>(xv);
  auto* y = static_cast<S<E>*>(yv);
  constexpr int64_t kChunk = 16384;  // elements a task: a fan-out (~6 us) pays from here
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  bool avx2 = false;
#if defined(__x86_64__)
  avx2 = has_avx2_fma();
#endif
  parallel_for(chunks, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kChunk, hi = std::min(count, end * kChunk);
#if defined(__x86_64__)
    if (avx2) return span_avx2<E>(x, y, lo, hi, approximate);
#endif
    (void)avx2;
    span_scalar<E>(x, y, lo, hi, approximate);
  });
}

}  // namespace

void gelu_inplace_f32(float* y, int64_t count, bool approximate) {
#if defined(__x86_64__)
  if (has_avx2_fma()) return span_avx2<Elt::kF32>(y, y, 0, count, approximate);
#endif
  span_scalar<Elt::kF32>(y, y, 0, count, approximate);
}

void gelu(Elt elt, const void* x, void* out, int64_t count, bool approximate) {
  switch (elt) {
    case Elt::kF32: return run<Elt::kF32>(x, out, count, approximate);
    case Elt::kF16: return run<Elt::kF16>(x, out, count, approximate);
    case Elt::kBF16: return run<Elt::kBF16>(x, out, count, approximate);
  }
}

}  // namespace vllm_metal::cpu
