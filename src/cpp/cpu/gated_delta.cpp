#include "cpu/gated_delta.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

float dot_scalar(const float* a, const float* b, int64_t begin, int64_t n) {
  float s = 0.0f;
  for (int64_t i = begin; i < n; ++i) s += a[i] * b[i];
  return s;
}

void axpby_scalar(float* y, float a, float b, const float* x, int64_t begin, int64_t n) {
  for (int64_t i = begin; i < n; ++i) y[i] = a * y[i] + b * x[i];
}

#if defined(__x86_64__)
VLLM_METAL_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  return hsum8(_mm256_add_ps(acc0, acc1)) + dot_scalar(a, b, i, n);
}

VLLM_METAL_AVX2 void axpby_avx2(float* y, float a, float b, const float* x, int64_t n) {
  const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(y + i),
                                            _mm256_mul_ps(vb, _mm256_loadu_ps(x + i))));
  }
  axpby_scalar(y, a, b, x, i, n);
}
#endif

#if defined(__aarch64__)
float dot_neon(const float* a, const float* b, int64_t n) {
  float32x4_t acc0 = vdupq_n_f32(0.0f), acc1 = vdupq_n_f32(0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    acc0 = vfmaq_f32(acc0, vld1q_f32(a + i), vld1q_f32(b + i));
    acc1 = vfmaq_f32(acc1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
  }
  return vaddvq_f32(vaddq_f32(acc0, acc1)) + dot_scalar(a, b, i, n);
}

void axpby_neon(float* y, float a, float b, const float* x, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    vst1q_f32(y + i, vfmaq_n_f32(vmulq_n_f32(vld1q_f32(x + i), b), vld1q_f32(y + i), a));
  }
  axpby_scalar(y, a, b, x, i, n);
}
#endif

inline float softplus(float x) {
  return x > 20.0f ? x : std::log1p(std::exp(x));  // log(1 + e^x) without overflow
}

// Float32 copies of the step's inputs the recurrence reuses for every state
// row: L2-normalized q (times 1/sqrt(dk)) and k, log decay and beta.
struct Prepared {
  std::vector<float> q, k, log_g, beta;
};

template <Elt E>
void l2_normalize(const S<E>* x, float* out, int64_t n, float eps, float scale) {
  to_floats(E, x, n, out);
  const float inv = scale / std::sqrt(dot_f32(out, out, n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] *= inv;
}

template <Elt E>
Prepared prepare(const GatedDeltaRows& a) {
  Prepared p;
  const int64_t qk = a.tokens * a.hk * a.dk;
  p.q.resize(qk);
  p.k.resize(qk);
  p.log_g.resize(a.tokens * a.hv);
  p.beta.resize(a.tokens * a.hv);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(a.dk));
  const auto* q = static_cast<const S<E>*>(a.q);
  const auto* k = static_cast<const S<E>*>(a.k);
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, a.hk * a.dk));
  parallel_for(a.tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < a.hk; ++h) {
        const int64_t o = (t * a.hk + h) * a.dk;
        l2_normalize<E>(q + o, p.q.data() + o, a.dk, a.eps, q_scale);
        l2_normalize<E>(k + o, p.k.data() + o, a.dk, a.eps, 1.0f);
      }
      for (int64_t h = 0; h < a.hv; ++h) {
        const int64_t o = t * a.hv + h;
        p.log_g[o] = -std::exp(a.a_log[h]) * softplus(a.a[o] + a.dt_bias[h]);
        p.beta[o] = 1.0f / (1.0f + std::exp(-a.b[o]));
      }
    }
  });
  return p;
}

// One token for `n` consecutive state rows s [n, dk] of a head: per row r,
// S[r] = g S[r] + beta (v[r] - g S[r].k) k, y[r] = S[r].q.
void step_rows_generic(float* s, int64_t n, int64_t dk, const float* k, const float* q,
                       float g, float beta, const float* v, float* y) {
  for (int64_t r = 0; r < n; ++r) {
    float* row = s + r * dk;
    const float delta = beta * (v[r] - g * dot_f32(row, k, dk));
    axpby_f32(row, g, delta, k, dk);
    y[r] = dot_f32(row, q, dk);
  }
}

#if defined(__x86_64__)
// Four rows at a time: k and q are loaded once for the four, and the four dot
// products are independent FMA chains.
VLLM_METAL_AVX2 void step_rows_avx2(float* s, int64_t n, int64_t dk, const float* k,
                                    const float* q, float g, float beta, const float* v,
                                    float* y) {
  const int64_t vec = dk - dk % 8;
  int64_t r = 0;
  for (; r + 4 <= n; r += 4) {
    float* row[4] = {s + r * dk, s + (r + 1) * dk, s + (r + 2) * dk, s + (r + 3) * dk};
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 kk = _mm256_loadu_ps(k + i);
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(row[j] + i), kk, acc[j]);
    }
    float delta[4];
    for (int j = 0; j < 4; ++j) {
      const float kv = hsum8(acc[j]) + dot_scalar(row[j], k, vec, dk);
      delta[j] = beta * (v[r + j] - g * kv);
      acc[j] = _mm256_setzero_ps();
    }
    const __m256 vg = _mm256_set1_ps(g);
    for (int64_t i = 0; i < vec; i += 8) {
      const __m256 kk = _mm256_loadu_ps(k + i), qq = _mm256_loadu_ps(q + i);
      for (int j = 0; j < 4; ++j) {
        const __m256 sv = _mm256_fmadd_ps(vg, _mm256_loadu_ps(row[j] + i),
                                          _mm256_mul_ps(_mm256_set1_ps(delta[j]), kk));
        _mm256_storeu_ps(row[j] + i, sv);
        acc[j] = _mm256_fmadd_ps(sv, qq, acc[j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      axpby_scalar(row[j], g, delta[j], k, vec, dk);
      y[r + j] = hsum8(acc[j]) + dot_scalar(row[j], q, vec, dk);
    }
  }
  step_rows_generic(s + r * dk, n - r, dk, k, q, g, beta, v + r, y + r);
}
#endif

// Rows of one (sequence, value head) are independent: each state row evolves
// alone. Work items are (sequence, head); tokens go in tiles of 32 whose q and
// k (32 KiB at dk 128) stay in L1/L2 while every block of 16 state rows (<= 16
// KiB, in L1) runs through the tile. Row by row over a long prompt, q and k
// would stream from memory once per row block instead.
template <Elt E>
void run_recurrent(const GatedDeltaRows& a, const Prepared& p) {
  constexpr int64_t kRows = 16, kTile = 32;
  const int64_t group = a.hv / a.hk;
  auto* y = static_cast<S<E>*>(a.y);
  const auto* v = static_cast<const S<E>*>(a.v);
  auto step = &step_rows_generic;
#if defined(__x86_64__)
  if (has_avx2_fma()) step = &step_rows_avx2;
#endif
  parallel_for(a.num_seqs * a.hv, 1, [&](int64_t begin, int64_t end) {
    float vr[kRows], yr[kRows];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / a.hv, h = item % a.hv, kh = h / group;
      float* st = a.state + (int64_t(a.slots[n]) * a.hv + h) * a.dv * a.dk;
      if (!a.has_initial_state[n]) std::fill(st, st + a.dv * a.dk, 0.0f);
      for (int64_t t0 = a.cu_seqlens[n]; t0 < a.cu_seqlens[n + 1]; t0 += kTile) {
        const int64_t t1 = std::min<int64_t>(a.cu_seqlens[n + 1], t0 + kTile);
        for (int64_t r0 = 0; r0 < a.dv; r0 += kRows) {
          const int64_t nr = std::min(a.dv - r0, kRows);
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t th = t * a.hv + h;
            for (int64_t r = 0; r < nr; ++r) vr[r] = EltTraits<E>::load(v + th * a.dv + r0 + r);
            step(st + r0 * a.dk, nr, a.dk, p.k.data() + (t * a.hk + kh) * a.dk,
                 p.q.data() + (t * a.hk + kh) * a.dk, std::exp(p.log_g[th]), p.beta[th], vr,
                 yr);
            for (int64_t r = 0; r < nr; ++r) EltTraits<E>::store(y + th * a.dv + r0 + r, yr[r]);
          }
        }
      }
    }
  });
}

// Chunked (WY) form over chunks of c tokens, per (sequence, head). With
// G_i = sum of log g over the chunk up to i and S0 the state at chunk start:
//   u_i = beta_i (v_i - e^{G_i} S0 k_i - sum_{j<i} e^{G_i - G_j} (k_i.k_j) u_j)
//   y_i = e^{G_i} S0 q_i + sum_{j<=i} e^{G_i - G_j} (q_i.k_j) u_j
//   S   = e^{G_last} S0 + sum_j e^{G_last - G_j} u_j k_j^T
// which is the recurrence unrolled (u_j = the delta written at token j); the
// state is read and written once per chunk instead of once per token.
template <Elt E>
void run_chunked(const GatedDeltaRows& a, const Prepared& p) {
  const int64_t c = a.chunk_size, dk = a.dk, dv = a.dv;
  const int64_t group = a.hv / a.hk;
  auto* y = static_cast<S<E>*>(a.y);
  const auto* v = static_cast<const S<E>*>(a.v);
  parallel_for(a.num_seqs * a.hv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(c * dv), qs(c * dv), u(c * dv), out(dv), G(c);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n = item / a.hv, h = item % a.hv, kh = h / group;
      float* st = a.state + (int64_t(a.slots[n]) * a.hv + h) * dv * dk;
      if (!a.has_initial_state[n]) std::fill(st, st + dv * dk, 0.0f);
      for (int64_t t0 = a.cu_seqlens[n]; t0 < a.cu_seqlens[n + 1]; t0 += c) {
        const int64_t len = std::min<int64_t>(c, a.cu_seqlens[n + 1] - t0);
        auto kq = [&](const std::vector<float>& x, int64_t i) {
          return x.data() + ((t0 + i) * a.hk + kh) * dk;
        };
        float acc = 0.0f;
        for (int64_t i = 0; i < len; ++i) G[i] = acc += p.log_g[(t0 + i) * a.hv + h];
        for (int64_t r = 0; r < dv; ++r) {
          const float* s = st + r * dk;
          for (int64_t i = 0; i < len; ++i) {
            w[i * dv + r] = dot_f32(s, kq(p.k, i), dk);
            qs[i * dv + r] = dot_f32(s, kq(p.q, i), dk);
          }
        }
        for (int64_t i = 0; i < len; ++i) {
          const float beta = p.beta[(t0 + i) * a.hv + h], gi = std::exp(G[i]);
          float* ui = u.data() + i * dv;
          for (int64_t r = 0; r < dv; ++r) {
            ui[r] = beta * (EltTraits<E>::load(v + ((t0 + i) * a.hv + h) * dv + r) -
                            gi * w[i * dv + r]);
          }
          for (int64_t j = 0; j < i; ++j) {
            const float aij = beta * std::exp(G[i] - G[j]) * dot_f32(kq(p.k, i), kq(p.k, j), dk);
            axpby_f32(ui, 1.0f, -aij, u.data() + j * dv, dv);
          }
          for (int64_t r = 0; r < dv; ++r) out[r] = gi * qs[i * dv + r];
          for (int64_t j = 0; j <= i; ++j) {
            const float cij = std::exp(G[i] - G[j]) * dot_f32(kq(p.q, i), kq(p.k, j), dk);
            axpby_f32(out.data(), 1.0f, cij, u.data() + j * dv, dv);
          }
          S<E>* yi = y + ((t0 + i) * a.hv + h) * dv;
          for (int64_t r = 0; r < dv; ++r) EltTraits<E>::store(yi + r, out[r]);
        }
        const float glast = G[len - 1];
        for (int64_t r = 0; r < dv; ++r) {
          float* s = st + r * dk;
          for (int64_t i = 0; i < dk; ++i) s[i] *= std::exp(glast);
          for (int64_t j = 0; j < len; ++j) {
            axpby_f32(s, 1.0f, std::exp(glast - G[j]) * u[j * dv + r], kq(p.k, j), dk);
          }
        }
      }
    }
  });
}

template <Elt E>
void run(const GatedDeltaRows& a) {
  const Prepared p = prepare<E>(a);
  if (a.chunk_size > 0) {
    run_chunked<E>(a, p);
  } else {
    run_recurrent<E>(a, p);
  }
}

}  // namespace

float dot_f32(const float* a, const float* b, int64_t n) {
#if defined(__x86_64__)
  if (has_avx2_fma()) return dot_avx2(a, b, n);
#elif defined(__aarch64__)
  return dot_neon(a, b, n);
#endif
  return dot_scalar(a, b, 0, n);
}

void axpby_f32(float* y, float a, float b, const float* x, int64_t n) {
#if defined(__x86_64__)
  if (has_avx2_fma()) return axpby_avx2(y, a, b, x, n);
#elif defined(__aarch64__)
  return axpby_neon(y, a, b, x, n);
#endif
  axpby_scalar(y, a, b, x, 0, n);
}

void gated_delta_rows(const GatedDeltaRows& a) {
  switch (a.elt) {
    case Elt::kF32: return run<Elt::kF32>(a);
    case Elt::kF16: return run<Elt::kF16>(a);
    case Elt::kBF16: return run<Elt::kBF16>(a);
  }
}

}  // namespace vllm_metal::cpu
