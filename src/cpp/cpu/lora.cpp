#include "cpu/lora.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

size_t elt_size(Elt e) { return e == Elt::kF32 ? 4 : 2; }

// Dot product with 8 independent partial sums (vectorizable, fixed order).
float dot(const float* a, const float* b, int64_t n) {
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

}  // namespace

void lora_apply_rows(const LoraApplyRows& p) {
  const size_t es = elt_size(p.elt);
  const auto* y = static_cast<const char*>(p.y);
  const auto* x = static_cast<const char*>(p.x);
  const auto* a = static_cast<const char*>(p.a);
  const auto* b = static_cast<const char*>(p.b);
  auto* out = static_cast<char*>(p.out);
  parallel_for(p.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(p.in_dim), wf(std::max(p.in_dim, p.rank)), h(p.rank), yf(p.out_dim);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t s = p.row_slot[t];
      const char* yr = y + t * p.out_dim * es;
      char* outr = out + t * p.out_dim * es;
      if (s < 0) {
        std::memcpy(outr, yr, p.out_dim * es);
        continue;
      }
      to_floats(p.elt, x + t * p.in_dim * es, p.in_dim, xf.data());
      const char* as = a + s * p.rank * p.in_dim * es;
      for (int64_t r = 0; r < p.rank; ++r) {
        to_floats(p.elt, as + r * p.in_dim * es, p.in_dim, wf.data());
        h[r] = dot(wf.data(), xf.data(), p.in_dim);
      }
      const float sc = p.scale[s];
      for (int64_t r = 0; r < p.rank; ++r) h[r] *= sc;
      to_floats(p.elt, yr, p.out_dim, yf.data());
      const char* bs = b + s * p.out_dim * p.rank * es;
      for (int64_t o = 0; o < p.out_dim; ++o) {
        to_floats(p.elt, bs + o * p.rank * es, p.rank, wf.data());
        yf[o] += dot(wf.data(), h.data(), p.rank);
      }
      from_floats(p.elt, yf.data(), p.out_dim, outr);
    }
  });
}

}  // namespace vllm_metal::cpu
