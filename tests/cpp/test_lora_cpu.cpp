// lora_apply's CPU kernel against a naive double-precision loop (mixed slots, base
// rows copied bit for bit, odd sizes, float32 and float16), and its planner's geometry.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/lora.h"
#include "lora_args.h"
#include "ops/lora.h"

namespace vc = vllm_metal::cpu;

namespace {

std::vector<float> randn(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

struct Case {
  int rows = 6, in = 37, out = 19, rank = 5, slots = 3;
  std::vector<int32_t> row_slot{2, -1, 0, 2, 1, -1};
};

std::vector<double> reference(const Case& c, const std::vector<float>& y, const std::vector<float>& x,
                              const std::vector<float>& a, const std::vector<float>& b,
                              const std::vector<float>& scale) {
  std::vector<double> out(y.begin(), y.end());
  for (int t = 0; t < c.rows; ++t) {
    const int s = c.row_slot[t];
    if (s < 0) continue;
    for (int o = 0; o < c.out; ++o) {
      double acc = 0;
      for (int r = 0; r < c.rank; ++r) {
        double h = 0;
        for (int i = 0; i < c.in; ++i) h += double(a[(s * c.rank + r) * c.in + i]) * x[t * c.in + i];
        acc += double(b[(s * c.out + o) * c.rank + r]) * scale[s] * h;
      }
      out[t * c.out + o] += acc;
    }
  }
  return out;
}

TEST(LoraCpu, MatchesNaiveLoopFloat32) {
  Case c;
  auto y = randn(c.rows * c.out, 1), x = randn(c.rows * c.in, 2);
  auto a = randn(c.slots * c.rank * c.in, 3), b = randn(c.slots * c.out * c.rank, 4);
  std::vector<float> scale{0.5f, 2.0f, 1.25f}, out(c.rows * c.out, NAN);
  vc::LoraApplyRows p;
  p.elt = vc::Elt::kF32;
  p.y = y.data(), p.x = x.data(), p.a = a.data(), p.b = b.data(), p.scale = scale.data();
  p.row_slot = c.row_slot.data(), p.out = out.data();
  p.rows = c.rows, p.in_dim = c.in, p.out_dim = c.out, p.rank = c.rank;
  vc::lora_apply_rows(p);
  auto ref = reference(c, y, x, a, b, scale);
  for (int t = 0; t < c.rows; ++t) {
    for (int o = 0; o < c.out; ++o) {
      const int i = t * c.out + o;
      if (c.row_slot[t] < 0) {
        EXPECT_EQ(std::memcmp(&out[i], &y[i], sizeof(float)), 0) << t;  // base rows: y's bits
      } else {
        EXPECT_NEAR(out[i], ref[i], 1e-4 * (1 + std::abs(ref[i]))) << t << "," << o;
      }
    }
  }
}

TEST(LoraCpu, MatchesNaiveLoopFloat16) {
  Case c;
  auto yf = randn(c.rows * c.out, 5), xf = randn(c.rows * c.in, 6);
  auto af = randn(c.slots * c.rank * c.in, 7), bf = randn(c.slots * c.out * c.rank, 8);
  auto to16 = [](std::vector<float>& v) {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      h[i] = vc::float_to_f16(v[i]);
      v[i] = vc::f16_to_float(h[i]);  // the reference sees the rounded inputs
    }
    return h;
  };
  auto y = to16(yf), x = to16(xf), a = to16(af), b = to16(bf);
  std::vector<float> scale{1.0f, 0.25f, 3.0f};
  std::vector<uint16_t> out(c.rows * c.out);
  vc::LoraApplyRows p;
  p.elt = vc::Elt::kF16;
  p.y = y.data(), p.x = x.data(), p.a = a.data(), p.b = b.data(), p.scale = scale.data();
  p.row_slot = c.row_slot.data(), p.out = out.data();
  p.rows = c.rows, p.in_dim = c.in, p.out_dim = c.out, p.rank = c.rank;
  vc::lora_apply_rows(p);
  auto ref = reference(c, yf, xf, af, bf, scale);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_NEAR(vc::f16_to_float(out[i]), ref[i], 2e-3 * (1 + std::abs(ref[i]))) << i;
  }
}

TEST(LoraPlanner, OneThreadgroupPerRowAndColumnBlock) {
  vllm_metal::LoraApplyProblem p;
  p.dtype = mlx::core::float16;
  p.rows = 9, p.in_dim = 576, p.out_dim = 1536 + 1, p.rank = 16, p.num_slots = 4;
  auto plan = vllm_metal::plan_lora_apply(p);
  ASSERT_EQ(plan.size(), 1u);
  const auto& l = plan[0];
  EXPECT_EQ(l.kernel, "lora_apply_float16");
  EXPECT_EQ(l.grid[1], 9u);
  EXPECT_GE(uint64_t(l.grid[0]) * l.threadgroup[0], 1537u);
  EXPECT_LT(uint64_t(l.grid[0] - 1) * l.threadgroup[0], 1537u);
  LoraApplyArgs args;
  ASSERT_EQ(l.args.size(), sizeof(args));
  std::memcpy(&args, l.args.data(), sizeof(args));
  EXPECT_EQ(args.rank, 16u);
  EXPECT_EQ(args.out_dim, 1537u);
  EXPECT_EQ(l.args_index, 7);
}

}  // namespace
