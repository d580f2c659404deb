#include "cpu/attention_vec.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

template <Elt E>
void dot_groups_scalar(const float* q, const S<E>* k, float* scores, int groups, int d) {
  for (int g = 0; g < groups; ++g) {
    float acc = 0.0f;
    for (int i = 0; i < d; ++i) acc += q[g * d + i] * EltTraits<E>::load(k + i);
    scores[g] = acc;
  }
}

template <Elt E>
void update_groups_scalar(float* acc, const float* rescale, const float* p, const S<E>* v,
                          int groups, int d) {
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < d; ++i) {
      acc[g * d + i] = acc[g * d + i] * rescale[g] + p[g] * EltTraits<E>::load(v + i);
    }
  }
}

#if defined(__x86_64__)
// d is a multiple of 8 on these paths (checked by the caller's dispatch).
template <Elt E>
VLLM_METAL_AVX2 void dot_groups_avx2(const float* q, const S<E>* k, float* scores, int groups,
                                     int d) {
  if (groups == 1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= d; i += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8<E>(k + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8<E>(k + i + 8), a1);
    }
    for (; i < d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8<E>(k + i), a0);
    scores[0] = hsum8(_mm256_add_ps(a0, a1));
    return;
  }
  // k is converted once per 8 lanes and reused by every head of the group
  for (int g = 0; g < groups; ++g) scores[g] = 0.0f;
  constexpr int kMaxGroups = 16;
  __m256 acc[kMaxGroups];
  for (int g0 = 0; g0 < groups; g0 += kMaxGroups) {
    int ng = groups - g0 < kMaxGroups ? groups - g0 : kMaxGroups;
    for (int g = 0; g < ng; ++g) acc[g] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      __m256 kv = load8<E>(k + i);
      for (int g = 0; g < ng; ++g) {
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (g0 + g) * d + i), kv, acc[g]);
      }
    }
    for (int g = 0; g < ng; ++g) scores[g0 + g] = hsum8(acc[g]);
  }
}

template <Elt E>
VLLM_METAL_AVX2 void update_groups_avx2(float* acc, const float* rescale, const float* p,
                                        const S<E>* v, int groups, int d) {
  for (int i = 0; i < d; i += 8) {
    __m256 vv = load8<E>(v + i);
    for (int g = 0; g < groups; ++g) {
      float* a = acc + g * d + i;
      __m256 r = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_set1_ps(rescale[g]));
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(p[g]), vv, r));
    }
  }
}
#endif

#if defined(__aarch64__)
template <Elt E>
void dot_groups_neon(const float* q, const S<E>* k, float* scores, int groups, int d) {
  for (int g = 0; g < groups; ++g) {
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = vdupq_n_f32(0.0f);
    const float* qg = q + g * d;
    for (int i = 0; i < d; i += 8) {
      a0 = vfmaq_f32(a0, vld1q_f32(qg + i), load4<E>(k + i));
      a1 = vfmaq_f32(a1, vld1q_f32(qg + i + 4), load4<E>(k + i + 4));
    }
    scores[g] = vaddvq_f32(vaddq_f32(a0, a1));
  }
}

template <Elt E>
void update_groups_neon(float* acc, const float* rescale, const float* p, const S<E>* v,
                        int groups, int d) {
  for (int i = 0; i < d; i += 4) {
    float32x4_t vv = load4<E>(v + i);
    for (int g = 0; g < groups; ++g) {
      float* a = acc + g * d + i;
      vst1q_f32(a, vfmaq_n_f32(vmulq_n_f32(vld1q_f32(a), rescale[g]), vv, p[g]));
    }
  }
}
#endif

}  // namespace

template <Elt E>
AttentionVecOps<E> attention_vec_ops(int head_size) {
  const bool vectorizable = head_size % 8 == 0;  // every supported head size is
#if defined(__x86_64__)
  if (vectorizable && has_avx2_fma()) return {&dot_groups_avx2<E>, &update_groups_avx2<E>};
#elif defined(__aarch64__)
  if (vectorizable) return {&dot_groups_neon<E>, &update_groups_neon<E>};
#endif
  return {&dot_groups_scalar<E>, &update_groups_scalar<E>};
}

template AttentionVecOps<Elt::kF32> attention_vec_ops<Elt::kF32>(int);
template AttentionVecOps<Elt::kF16> attention_vec_ops<Elt::kF16>(int);
template AttentionVecOps<Elt::kBF16> attention_vec_ops<Elt::kBF16>(int);

}  // namespace vllm_metal::cpu
