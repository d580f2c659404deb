#include "cpu/causal_conv1d.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/vec_exp.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

constexpr int64_t kBlock = 256;  // channels per work item: 1 KiB of a float row

void fma_scalar(float* acc, const float* w, const float* x, int64_t begin, int64_t n) {
  for (int64_t i = begin; i < n; ++i) acc[i] += w[i] * x[i];
}

// out = silu(acc) (or acc), rounded to E.
template <Elt E>
void finish_scalar(const float* acc, S<E>* out, int64_t begin, int64_t n, bool silu) {
  for (int64_t i = begin; i < n; ++i) {
    const float v = acc[i];
    EltTraits<E>::store(out + i, silu ? v / (1.0f + std::exp(-v)) : v);
  }
}

#if defined(__x86_64__)
template <Elt E>
VLLM_METAL_AVX2 void finish_avx2(const float* acc, S<E>* out, int64_t n, bool silu) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(acc + i);
    if (silu) v = _mm256_div_ps(v, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, v))));
    store8<E>(out + i, v);
  }
  finish_scalar<E>(acc, out, i, n, silu);
}

VLLM_METAL_AVX2 void fma_avx2(float* acc, const float* w, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i),
                                              _mm256_loadu_ps(acc + i)));
  }
  fma_scalar(acc, w, x, i, n);
}
#endif

#if defined(__aarch64__)
void fma_neon(float* acc, const float* w, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    vst1q_f32(acc + i, vfmaq_f32(vld1q_f32(acc + i), vld1q_f32(w + i), vld1q_f32(x + i)));
  }
  fma_scalar(acc, w, x, i, n);
}
#endif

using FmaFn = void (*)(float*, const float*, const float*, int64_t);

void fma_generic(float* acc, const float* w, const float* x, int64_t n) {
  fma_scalar(acc, w, x, 0, n);
}

FmaFn pick_fma() {
#if defined(__x86_64__)
  if (has_avx2_fma()) return &fma_avx2;
#elif defined(__aarch64__)
  return &fma_neon;
#endif
  return &fma_generic;
}

template <Elt E>
void run(const CausalConv1dRows& a) {
  using T = EltTraits<E>;
  const auto* x = static_cast<const S<E>*>(a.x);
  const auto* w = static_cast<const S<E>*>(a.weight);
  const auto* bias = static_cast<const S<E>*>(a.bias);
  auto* state = static_cast<S<E>*>(a.state);
  auto* out = static_cast<S<E>*>(a.out);
  const int64_t c = a.channels, k = a.width, m = k - 1;
  const int64_t blocks = (c + kBlock - 1) / kBlock;
  const FmaFn fma = pick_fma();
  auto finish = [](const float* acc, S<E>* o, int64_t n, bool silu) {
#if defined(__x86_64__)
    if (has_avx2_fma()) return finish_avx2<E>(acc, o, n, silu);
#endif
    finish_scalar<E>(acc, o, 0, n, silu);
  };
  parallel_for(a.num_seqs * blocks, 1, [&](int64_t begin, int64_t end) {
    // taps [k][kBlock] (weight transposed), ring [m][kBlock] of past inputs,
    // oldest at `head`; acc and the current input row
    std::vector<float> taps(k * kBlock), ring(m * kBlock), acc(kBlock), cur(kBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / blocks;
      const int64_t c0 = (item % blocks) * kBlock, nc = std::min(kBlock, c - c0);
      S<E>* st = state + (int64_t(a.slots[n]) * c + c0) * m;
      const bool init = a.has_initial_state[n] != 0;
      for (int64_t i = 0; i < nc; ++i) {
        for (int64_t j = 0; j < k; ++j) taps[j * kBlock + i] = T::load(w + (c0 + i) * k + j);
        for (int64_t j = 0; j < m; ++j) ring[j * kBlock + i] = init ? T::load(st + i * m + j) : 0.0f;
      }
      int64_t head = 0;
      for (int64_t t = a.cu_seqlens[n]; t < a.cu_seqlens[n + 1]; ++t) {
        for (int64_t i = 0; i < nc; ++i) {
          cur[i] = T::load(x + t * c + c0 + i);
          acc[i] = bias ? T::load(bias + c0 + i) : 0.0f;
        }
        for (int64_t j = 0; j < m; ++j) {
          fma(acc.data(), taps.data() + j * kBlock, ring.data() + ((head + j) % m) * kBlock, nc);
        }
        fma(acc.data(), taps.data() + m * kBlock, cur.data(), nc);
        std::copy(cur.begin(), cur.begin() + nc, ring.begin() + head * kBlock);
        head = (head + 1) % m;
        finish(acc.data(), out + t * c + c0, nc, a.silu);
      }
      const float* order[8];  // ring rows oldest first (no division per element)
      for (int64_t j = 0; j < m; ++j) order[j] = ring.data() + ((head + j) % m) * kBlock;
      for (int64_t i = 0; i < nc; ++i) {
        for (int64_t j = 0; j < m; ++j) T::store(st + i * m + j, order[j][i]);
      }
    }
  });
}

}  // namespace

void causal_conv1d_rows(const CausalConv1dRows& a) {
  switch (a.elt) {
    case Elt::kF32: return run<Elt::kF32>(a);
    case Elt::kF16: return run<Elt::kF16>(a);
    case Elt::kBF16: return run<Elt::kBF16>(a);
  }
}

}  // namespace vllm_metal::cpu
