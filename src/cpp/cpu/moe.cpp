#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

float dot_scalar(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
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
  float s = hsum8(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}
#endif

using DotFn = float (*)(const float*, const float*, int64_t);

DotFn pick_dot() {
#if defined(__x86_64__)
  if (has_avx2_fma()) return dot_avx2;
#endif
  return dot_scalar;
}

int64_t elt_size(Elt e) { return e == Elt::kF32 ? 4 : 2; }

}  // namespace

void moe_route_token(const float* logits, int64_t num_experts, int64_t top_k, bool sigmoid,
                     bool renormalize, int32_t* ids, float* weights) {
  float mx = -INFINITY;
  for (int64_t e = 0; e < num_experts; ++e) mx = std::max(mx, logits[e]);
  float denom = 0.0f;
  if (!sigmoid) {
    for (int64_t e = 0; e < num_experts; ++e) denom += std::exp(logits[e] - mx);
  }
  // k passes of selection in the order (larger logit, then lower id), as the Metal kernel
  float pv = INFINITY;
  int64_t pi = 0;
  float total = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    float best = -INFINITY;
    int64_t bi = num_experts;
    for (int64_t e = 0; e < num_experts; ++e) {
      const float v = logits[e];
      const bool ok = j == 0 || v < pv || (v == pv && e > pi);
      if (ok && (bi == num_experts || v > best)) {
        best = v;
        bi = e;
      }
    }
    pv = best;
    pi = bi;
    const float w = sigmoid ? 1.0f / (1.0f + std::exp(-best)) : std::exp(best - mx) / denom;
    ids[j] = static_cast<int32_t>(bi);
    weights[j] = w;
    total += w;
  }
  if (renormalize && total > 0.0f) {
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= total;
  }
}

void fused_moe_rows(const MoeRows& a) {
  const int64_t t_n = a.num_tokens, h_n = a.hidden, e_n = a.num_experts, i_n = a.inter,
                k = a.top_k;
  const int64_t slots = t_n * k;
  for (int64_t t = 0; t < t_n; ++t) {
    moe_route_token(a.logits + t * e_n, e_n, k, a.sigmoid, a.renormalize, a.ids + t * k,
                    a.weights + t * k);
  }
  // slots grouped by expert (counting sort keeps slot order within an expert)
  std::vector<int64_t> start(e_n + 1, 0);
  for (int64_t s = 0; s < slots; ++s) ++start[a.ids[s] + 1];
  for (int64_t e = 0; e < e_n; ++e) start[e + 1] += start[e];
  std::vector<int64_t> order(slots);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < slots; ++s) order[fill[a.ids[s]]++] = s;
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < e_n; ++e) {
    if (start[e + 1] > start[e]) active.push_back(e);
  }

  std::vector<float> xf(t_n * h_n);
  const int64_t x_row = h_n * elt_size(a.elt);
  for (int64_t t = 0; t < t_n; ++t) {
    to_floats(a.elt, static_cast<const char*>(a.x) + t * x_row, h_n, xf.data() + t * h_n);
  }
  const DotFn dot = pick_dot();
  const int64_t w_size = elt_size(a.w_elt);
  const char* wg = static_cast<const char*>(a.w_gate);
  const char* wu = static_cast<const char*>(a.w_up);
  const char* wd = static_cast<const char*>(a.w_down);

  // gate/up: items are (active expert, row i); each row converted once, used by all its slots
  std::vector<float> act(slots * i_n);
  const int64_t items = static_cast<int64_t>(active.size()) * i_n;
  parallel_for(items, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> g_row(h_n), u_row(h_n);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t e = active[it / i_n], i = it % i_n;
      const int64_t off = (e * i_n + i) * h_n * w_size;
      to_floats(a.w_elt, wg + off, h_n, g_row.data());
      to_floats(a.w_elt, wu + off, h_n, u_row.data());
      for (int64_t o = start[e]; o < start[e + 1]; ++o) {
        const int64_t s = order[o];
        const float* xr = xf.data() + (s / k) * h_n;
        const float g = dot(xr, g_row.data(), h_n), u = dot(xr, u_row.data(), h_n);
        act[s * i_n + i] = g / (1.0f + std::exp(-g)) * u;
      }
    }
  });

  // down: threaded over output columns h, so the float accumulators never race
  std::vector<float> acc(t_n * h_n, 0.0f);
  parallel_for(h_n, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> d_row(i_n);
    for (int64_t e : active) {
      for (int64_t h = begin; h < end; ++h) {
        to_floats(a.w_elt, wd + (e * h_n + h) * i_n * w_size, i_n, d_row.data());
        for (int64_t o = start[e]; o < start[e + 1]; ++o) {
          const int64_t s = order[o];
          acc[(s / k) * h_n + h] += a.weights[s] * dot(act.data() + s * i_n, d_row.data(), i_n);
        }
      }
    }
  });
  for (int64_t t = 0; t < t_n; ++t) {
    from_floats(a.elt, acc.data() + t * h_n, h_n, static_cast<char*>(a.out) + t * x_row);
  }
}

}  // namespace vllm_metal::cpu
