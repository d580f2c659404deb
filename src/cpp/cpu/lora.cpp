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
  const int64_t in = p.in_dim, od = p.out_dim, rank = p.rank;

  // The slots this step uses, each converted once: A as float [R, in], B transposed to
  // float [R, out] so the expand step is R contiguous axpys per row.
  std::vector<int32_t> used;
  for (int64_t t = 0; t < p.rows; ++t) {
    const int32_t s = p.row_slot[t];
    if (s >= 0 && std::find(used.begin(), used.end(), s) == used.end()) used.push_back(s);
  }
  std::vector<int64_t> index_of_slot(used.empty() ? 0 : *std::max_element(used.begin(), used.end()) + 1, -1);
  for (size_t i = 0; i < used.size(); ++i) index_of_slot[used[i]] = static_cast<int64_t>(i);
  std::vector<float> af(used.size() * rank * in), bt(used.size() * rank * od);
  parallel_for(static_cast<int64_t>(used.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(rank);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = used[i];
      to_floats(p.elt, a + s * rank * in * es, rank * in, af.data() + i * rank * in);
      float* bti = bt.data() + i * rank * od;
      const char* bs = b + s * od * rank * es;
      for (int64_t o = 0; o < od; ++o) {
        to_floats(p.elt, bs + o * rank * es, rank, row.data());
        for (int64_t r = 0; r < rank; ++r) bti[r * od + o] = row[r];
      }
    }
  });

  parallel_for(p.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), h(rank), yf(od);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t s = p.row_slot[t];
      const char* yr = y + t * od * es;
      char* outr = out + t * od * es;
      if (s < 0) {
        if (outr != yr) std::memcpy(outr, yr, od * es);  // out may be y itself
        continue;
      }
      const int64_t i = index_of_slot[s];
      to_floats(p.elt, x + t * in * es, in, xf.data());
      const float* as = af.data() + i * rank * in;
      const float sc = p.scale[s];
      for (int64_t r = 0; r < rank; ++r) h[r] = sc * dot(as + r * in, xf.data(), in);
      to_floats(p.elt, yr, od, yf.data());
      const float* bs = bt.data() + i * rank * od;
      for (int64_t r = 0; r < rank; ++r) {
        const float hr = h[r];
        const float* br = bs + r * od;
        for (int64_t o = 0; o < od; ++o) yf[o] += hr * br[o];
      }
      from_floats(p.elt, yf.data(), od, outr);
    }
  });
}

}  // namespace vllm_metal::cpu
