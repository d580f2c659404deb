// The CPU kernels on raw buffers against double-precision references.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cpu/reshape_and_cache.h"
#include "cpu/rms_norm.h"

namespace c = vllm_metal::cpu;

namespace {

template <c::Elt E>
std::vector<typename c::EltTraits<E>::Storage> random_elts(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<typename c::EltTraits<E>::Storage> v(n);
  for (auto& x : v) c::EltTraits<E>::store(&x, d(rng));
  return v;
}

template <c::Elt E>
void check_rms_norm(int64_t rows, int64_t hidden, bool fused, double tol) {
  using T = c::EltTraits<E>;
  auto x = random_elts<E>(rows * hidden, 1), r = random_elts<E>(rows * hidden, 2);
  auto w = random_elts<E>(hidden, 3);
  std::vector<typename T::Storage> y(rows * hidden), h(rows * hidden);
  c::RmsNormRows a;
  a.elt = E;
  a.x = x.data();
  a.residual = fused ? r.data() : nullptr;
  a.weight = w.data();
  a.out = y.data();
  a.residual_out = fused ? h.data() : nullptr;
  a.rows = rows;
  a.hidden = hidden;
  a.x_row_stride = a.residual_row_stride = hidden;
  a.eps = 1e-5f;
  c::rms_norm_rows(a);
  for (int64_t i = 0; i < rows; ++i) {
    std::vector<double> v(hidden);
    double ss = 0;
    for (int64_t j = 0; j < hidden; ++j) {
      float xv = T::load(&x[i * hidden + j]);
      v[j] = fused ? c::round_to<E>(xv + T::load(&r[i * hidden + j])) : xv;
      if (fused) {
        ASSERT_EQ(T::load(&h[i * hidden + j]), static_cast<float>(v[j]));
      }
      ss += v[j] * v[j];
    }
    double inv = 1.0 / std::sqrt(ss / hidden + 1e-5);
    for (int64_t j = 0; j < hidden; ++j) {
      double ref = v[j] * inv * T::load(&w[j]);
      ASSERT_NEAR(T::load(&y[i * hidden + j]), ref, tol * std::max(1.0, std::fabs(ref)))
          << "row " << i << " col " << j << " of " << rows << "x" << hidden;
    }
  }
}

}  // namespace

TEST(RmsNormCpu, MatchesReferenceAcrossTailsAndDtypes) {
  // lengths around the 8- and 16-wide vector loops
  for (int64_t hidden : {1, 7, 8, 9, 15, 16, 17, 33, 576, 4099}) {
    for (bool fused : {false, true}) {
      check_rms_norm<c::Elt::kF32>(3, hidden, fused, 2e-6);
      check_rms_norm<c::Elt::kF16>(3, hidden, fused, 2e-3);
      check_rms_norm<c::Elt::kBF16>(3, hidden, fused, 1.6e-2);
    }
  }
  check_rms_norm<c::Elt::kF16>(1000, 64, true, 2e-3);  // many rows across threads
}

TEST(ReshapeAndCacheCpu, ScattersStridedTokensAndSkipsPadding) {
  const int64_t t = 9, h = 3, d = 5, slots = 20;
  // key as a [t, d, h] buffer viewed as [t, h, d]: head stride 1, dim stride h
  std::vector<float> key(t * h * d), value(t * h * d);
  for (size_t i = 0; i < key.size(); ++i) {
    key[i] = static_cast<float>(i);
    value[i] = -static_cast<float>(i);
  }
  std::vector<int64_t> slot_mapping = {3, -1, 0, 19, 7, -5, 8, 1, 12};
  std::vector<float> kc(slots * h * d, 0.5f), vc(slots * h * d, 0.5f);
  c::CacheScatter a;
  a.key = key.data();
  a.value = value.data();
  a.slot_mapping = slot_mapping.data();
  a.key_cache = kc.data();
  a.value_cache = vc.data();
  a.key_strides[0] = h * d;
  a.key_strides[1] = 1;
  a.key_strides[2] = h;
  a.value_strides[0] = h * d;
  a.value_strides[1] = d;
  a.value_strides[2] = 1;
  a.num_tokens = t;
  a.num_heads = h;
  a.head_size = d;
  a.num_slots = slots;
  a.itemsize = 4;
  ASSERT_EQ(c::find_out_of_range_slot(slot_mapping.data(), t, slots), -1);
  c::scatter_into_cache(a);
  for (int64_t s = 0; s < slots; ++s) {
    int64_t tok = -1;
    for (int64_t i = 0; i < t; ++i)
      if (slot_mapping[i] == s) tok = i;
    for (int64_t hh = 0; hh < h; ++hh) {
      for (int64_t dd = 0; dd < d; ++dd) {
        float k = kc[(s * h + hh) * d + dd], v = vc[(s * h + hh) * d + dd];
        if (tok < 0) {
          ASSERT_EQ(k, 0.5f);
          ASSERT_EQ(v, 0.5f);
        } else {
          ASSERT_EQ(k, key[tok * h * d + dd * h + hh]);
          ASSERT_EQ(v, value[tok * h * d + hh * d + dd]);
        }
      }
    }
  }
  slot_mapping[4] = slots;
  EXPECT_EQ(c::find_out_of_range_slot(slot_mapping.data(), t, slots), 4);
}
