// The rope CPU kernel on raw buffers against long-double references (no MLX;
// also built for arm64 and run under qemu by tests/py/test_arm64_cpu_kernels.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/rope.h"

namespace c = vllm_metal::cpu;

namespace {

constexpr long double kTwoPiL = 6.283185307179586476925286766559L;

std::vector<double> default_inv_freq(int64_t rotary_dim, double base) {
  std::vector<double> f(rotary_dim / 2);
  for (size_t i = 0; i < f.size(); ++i) f[i] = std::pow(base, -2.0 * double(i) / rotary_dim);
  return f;
}

std::vector<uint32_t> table_of(const std::vector<double>& inv_freq) {
  std::vector<uint32_t> t(2 * inv_freq.size());
  c::rope_turn_table(inv_freq.data(), static_cast<int64_t>(inv_freq.size()), t.data());
  return t;
}

// cos/sin of position * inv_freq, the angle reduced modulo 2 pi in long double.
void reference_cos_sin(int64_t position, double inv_freq, double* cs, double* sn) {
  long double a = std::fmod(static_cast<long double>(position) * inv_freq, kTwoPiL);
  *cs = static_cast<double>(std::cos(a));
  *sn = static_cast<double>(std::sin(a));
}

template <c::Elt E>
using Store = typename c::EltTraits<E>::Storage;

template <c::Elt E>
std::vector<Store<E>> random_elts(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<Store<E>> v(n);
  for (auto& x : v) c::EltTraits<E>::store(&x, d(rng));
  return v;
}

struct Shape {
  int64_t tokens, heads, head_size, rotary_dim;
  bool neox;
  int64_t token_pad = 0, head_pad = 0;  // extra elements between tokens / heads of x
  int64_t dim_stride = 1;
};

// Runs rope_rows on a padded (strided) x and checks every element.
template <c::Elt E>
void check_rope(const Shape& s, bool positions_int64, double tol, bool in_place = false) {
  using T = c::EltTraits<E>;
  const int64_t head_stride = s.head_size * s.dim_stride + s.head_pad;
  const int64_t token_stride = s.heads * head_stride + s.token_pad;
  auto x = random_elts<E>(s.tokens * token_stride, 7);
  std::vector<int64_t> pos64(s.tokens);
  std::vector<int32_t> pos32(s.tokens);
  std::mt19937 rng(11);
  for (int64_t t = 0; t < s.tokens; ++t) {
    pos64[t] = t == 0 ? 0 : static_cast<int64_t>(rng() % 200000);
    pos32[t] = static_cast<int32_t>(pos64[t]);
  }
  auto inv = default_inv_freq(s.rotary_dim, 10000.0);
  for (auto& f : inv) f *= 0.75;  // a non-default table
  auto table = table_of(inv);
  const float mscale = 1.25f;
  std::vector<Store<E>> out(s.tokens * s.heads * s.head_size);
  std::vector<Store<E>> x_before = x;
  c::RopeRows a;
  a.elt = E;
  a.x = x.data();
  a.out = in_place ? static_cast<void*>(x.data()) : static_cast<void*>(out.data());
  a.positions = positions_int64 ? static_cast<const void*>(pos64.data()) : pos32.data();
  a.positions_int64 = positions_int64;
  a.table = table.data();
  a.tokens = s.tokens;
  a.heads = s.heads;
  a.head_size = s.head_size;
  a.rotary_dim = s.rotary_dim;
  a.x_token_stride = token_stride;
  a.x_head_stride = head_stride;
  a.x_dim_stride = s.dim_stride;
  a.neox = s.neox;
  a.mscale = mscale;
  c::rope_rows(a);
  const Store<E>* y = in_place ? x.data() : out.data();
  const int64_t half = s.rotary_dim / 2;
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const Store<E>* xh = x_before.data() + t * token_stride + h * head_stride;
      const Store<E>* yh = y + (t * s.heads + h) * s.head_size;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t i1 = s.neox ? i : 2 * i, i2 = s.neox ? i + half : 2 * i + 1;
        double cs, sn;
        reference_cos_sin(pos64[t], inv[i], &cs, &sn);
        const double xa = T::load(xh + i1 * s.dim_stride), xb = T::load(xh + i2 * s.dim_stride);
        const double r1 = (xa * cs - xb * sn) * mscale, r2 = (xb * cs + xa * sn) * mscale;
        const double scale = std::max(1.0, std::fabs(xa) + std::fabs(xb));
        ASSERT_NEAR(T::load(yh + i1), r1, tol * scale) << "token " << t << " head " << h
                                                       << " pair " << i;
        ASSERT_NEAR(T::load(yh + i2), r2, tol * scale) << "token " << t << " head " << h
                                                       << " pair " << i;
      }
      for (int64_t j = s.rotary_dim; j < s.head_size; ++j) {
        ASSERT_EQ(T::load(yh + j), T::load(xh + j * s.dim_stride)) << "pass-through dim " << j;
      }
    }
  }
}

}  // namespace

TEST(RopeCpu, TurnTableHoldsTheFractionOfATurnPerPosition) {
  const double two_pi = 6.283185307179586;
  std::vector<double> inv = {two_pi * 0.25, two_pi * 1.25, two_pi * 0.5, 0.0};
  auto t = table_of(inv);
  // 64-bit turn fraction of pair i, compared modulo 2^64 within the rounding
  // of the double inputs (2 pi * k is not exact)
  auto near = [&](int i, uint64_t expect) {
    const uint64_t u = (uint64_t(t[4 + i]) << 32) | t[i];
    const auto diff = static_cast<int64_t>(u - expect);
    EXPECT_LT(std::llabs(diff), int64_t(1) << 12) << "pair " << i << ": " << u;
  };
  near(0, uint64_t(1) << 62);  // a quarter turn
  near(1, uint64_t(1) << 62);  // whole turns dropped
  near(2, uint64_t(1) << 63);  // half a turn
  EXPECT_EQ(t[3], 0u);
  EXPECT_EQ(t[7], 0u);
}

TEST(RopeCpu, CosSinStayAccurateAtAnyPosition) {
  // 67 frequencies: the 8- and 4-wide loops and their tails; a fast and a
  // tiny rate at the end
  auto inv = default_inv_freq(128, 10000.0);
  inv.insert(inv.end(), {3.0, 0.999, 1e-7});
  const auto table = table_of(inv);
  const int64_t n = static_cast<int64_t>(inv.size());
  std::vector<float> cs(n), sn(n);
  for (int64_t pos : {int64_t(0), int64_t(1), int64_t(2), int64_t(1000), int64_t(131071),
                      int64_t(1) << 24, (int64_t(1) << 24) + 1, (int64_t(1) << 31) - 1,
                      int64_t(-1), int64_t(-98765), int64_t(3000000017)}) {
    c::rope_cos_sin(pos, table.data(), n, n, 1.0f, cs.data(), sn.data());
    for (int64_t i = 0; i < n; ++i) {
      double rc, rs;
      reference_cos_sin(pos, inv[i], &rc, &rs);
      ASSERT_NEAR(cs[i], rc, 1e-6) << "position " << pos << " pair " << i;
      ASSERT_NEAR(sn[i], rs, 1e-6) << "position " << pos << " pair " << i;
    }
  }
  c::rope_cos_sin(5, table.data(), n, n, -2.0f, cs.data(), sn.data());
  double rc, rs;
  reference_cos_sin(5, inv[3], &rc, &rs);
  EXPECT_NEAR(cs[3], -2.0 * rc, 2e-6);
  EXPECT_NEAR(sn[3], -2.0 * rs, 2e-6);
}

TEST(RopeCpu, MatchesReferenceAcrossTailsPairingsAndDtypes) {
  // half sizes around the 8-wide (AVX2) and 4-wide (NEON) loops
  for (int64_t half : {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 40, 64}) {
    for (bool neox : {true, false}) {
      for (int64_t extra : {0, 3}) {
        Shape s{3, 2, 2 * half + extra, 2 * half, neox, 5, 2};
        check_rope<c::Elt::kF32>(s, true, 1e-6);
        check_rope<c::Elt::kF16>(s, false, 2e-3);
        check_rope<c::Elt::kBF16>(s, true, 1.6e-2);
      }
    }
  }
}

TEST(RopeCpu, StridedLastAxisAndInPlace) {
  for (bool neox : {true, false}) {
    check_rope<c::Elt::kF32>({4, 3, 80, 40, neox, 0, 0, 2}, true, 1e-6);   // stride-2 dims
    check_rope<c::Elt::kBF16>({4, 3, 96, 96, neox, 0, 0, 3}, false, 1.6e-2);
    check_rope<c::Elt::kF32>({5, 3, 128, 64, neox}, true, 1e-6, /*in_place=*/true);
    check_rope<c::Elt::kF16>({5, 3, 80, 80, neox}, false, 2e-3, /*in_place=*/true);
  }
}

TEST(RopeCpu, ManyTokensAcrossThreads) {
  const int saved = c::num_threads();
  c::set_num_threads(4);
  check_rope<c::Elt::kBF16>({700, 4, 64, 64, true}, true, 1.6e-2);
  check_rope<c::Elt::kF32>({333, 2, 128, 32, false, 1, 0}, false, 1e-6);
  c::set_num_threads(saved);
}
