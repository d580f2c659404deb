// Float16/bfloat16 conversions: scalar against the compiler's _Float16 and an
// exact nearest-even search; the AVX2 paths against the scalar ones.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cpu/vec.h"

namespace c = vllm_metal::cpu;

namespace {

std::vector<float> awkward_floats() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f,
                          5.96e-8f, 2.98e-8f, 6.1e-5f, 6.097e-5f, 1e30f, -1e30f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::denorm_min(), 3.0e38f};
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    uint32_t bits = rng();
    float f = c::bits_to_float(bits);
    if (!std::isnan(f)) v.push_back(f);
  }
  std::uniform_real_distribution<float> small(-70000.0f, 70000.0f);
  for (int i = 0; i < 100000; ++i) v.push_back(small(rng));
  return v;
}

}  // namespace

#if defined(__x86_64__) || defined(__aarch64__)
#if defined(__aarch64__)
using CompilerHalf = __fp16;  // GCC's C++ front end has no _Float16 on arm64
#else
using CompilerHalf = _Float16;
#endif

TEST(Vec, Float16MatchesTheCompilersConversion) {
  for (float f : awkward_floats()) {
    CompilerHalf h = static_cast<CompilerHalf>(f);
    uint16_t expect;
    std::memcpy(&expect, &h, 2);
    ASSERT_EQ(c::float_to_f16(f), expect) << "f=" << f;
  }
  for (uint32_t b = 0; b < 65536; ++b) {
    uint16_t bits = static_cast<uint16_t>(b);
    CompilerHalf h;
    std::memcpy(&h, &bits, 2);
    float expect = static_cast<float>(h);
    float got = c::f16_to_float(bits);
    if (std::isnan(expect)) {
      ASSERT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(c::float_to_bits(got), c::float_to_bits(expect)) << "bits=" << b;
    }
  }
}
#endif

TEST(Vec, BFloat16RoundsToNearestEven) {
  for (float f : awkward_floats()) {
    uint16_t got = c::float_to_bf16(f);
    uint32_t bits = c::float_to_bits(f);
    uint16_t lo = static_cast<uint16_t>(bits >> 16);  // truncation toward zero
    double dlo = c::bf16_to_float(lo), dhi = c::bf16_to_float(static_cast<uint16_t>(lo + 1));
    // past the largest bf16 the next step is 2^128 (IEEE overflow rounds to inf)
    if (std::isinf(dhi) && !std::isinf(f)) dhi = std::copysign(std::ldexp(1.0, 128), f);
    double err_lo = std::fabs(f - dlo), err_hi = std::fabs(f - dhi);
    uint16_t expect = err_lo < err_hi ? lo : err_hi < err_lo ? static_cast<uint16_t>(lo + 1)
                                                              : static_cast<uint16_t>(lo + (lo & 1));
    if (std::isinf(f)) expect = lo;
    ASSERT_EQ(got, expect) << "f=" << f;
  }
  EXPECT_TRUE(std::isnan(c::bf16_to_float(c::float_to_bf16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(c::bf16_to_float(c::float_to_bf16(c::bits_to_float(0x7fffffffu)))));
}

#if defined(__x86_64__)
template <c::Elt E>
VLLM_METAL_AVX2 void check_avx2_matches_scalar() {
  using S = typename c::EltTraits<E>::Storage;
  auto values = awkward_floats();
  values.push_back(std::nanf(""));
  values.resize(values.size() / 8 * 8);
  std::vector<S> scalar(values.size()), vector(values.size());
  for (size_t i = 0; i < values.size(); ++i) c::EltTraits<E>::store(&scalar[i], values[i]);
  for (size_t i = 0; i < values.size(); i += 8) {
    c::store8<E>(&vector[i], _mm256_loadu_ps(&values[i]));
  }
  for (size_t i = 0; i < values.size(); ++i) {
    float a = c::EltTraits<E>::load(&scalar[i]), b = c::EltTraits<E>::load(&vector[i]);
    if (std::isnan(a)) {
      ASSERT_TRUE(std::isnan(b));
      continue;
    }
    ASSERT_EQ(c::float_to_bits(a), c::float_to_bits(b)) << "value " << values[i];
  }
  std::vector<float> loaded(8);
  for (size_t i = 0; i < values.size(); i += 8) {
    _mm256_storeu_ps(loaded.data(), c::load8<E>(&scalar[i]));
    for (int j = 0; j < 8; ++j) {
      float a = c::EltTraits<E>::load(&scalar[i + j]);
      ASSERT_TRUE(a == loaded[j] || (std::isnan(a) && std::isnan(loaded[j])));
    }
  }
}

TEST(Vec, Avx2ConversionsMatchScalar) {
  if (!c::has_avx2_fma()) GTEST_SKIP() << "CPU has no AVX2/FMA/F16C";
  check_avx2_matches_scalar<c::Elt::kF16>();
  check_avx2_matches_scalar<c::Elt::kBF16>();
  check_avx2_matches_scalar<c::Elt::kF32>();
}
#endif
