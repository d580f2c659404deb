// rope's planner (pure: geometry and argument packing), its scaling parser and
// frequency formulas, and the cached turn tables.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <stdexcept>

#include "ops/rope.h"
#include "ops/rope_scaling.h"
#include "rope_args.h"

namespace vm = vllm_metal;
namespace mx = mlx::core;

namespace {

constexpr double kPi = 3.14159265358979323846;

RopeArgs args_of(const vm::KernelLaunch& l) {
  RopeArgs a;
  EXPECT_EQ(l.args.size(), sizeof(a));
  std::memcpy(&a, l.args.data(), sizeof(a));
  return a;
}

// Expects parse/compute to throw std::invalid_argument starting with "[rope] "
// and containing `what`.
template <typename F>
void expect_rope_error(F f, const std::string& what) {
  try {
    f();
    FAIL() << "no error; expected " << what;
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("[rope] ", 0), 0u) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

}  // namespace

TEST(RopePlanner, OneThreadgroupPerTokenWithPackedArgs) {
  vm::RopeProblem p;
  p.dtype = mx::bfloat16;
  p.positions_dtype = mx::int32;
  p.tokens = 37;
  p.heads = 9;
  p.head_size = 80;
  p.rotary_dim = 40;
  p.x_token_stride = 1200;
  p.x_head_stride = 80;
  p.x_dim_stride = 1;
  p.neox = false;
  p.mscale = 1.5f;
  auto plan = vm::plan_rope(p);
  ASSERT_EQ(plan.size(), 1u);
  const auto& l = plan[0];
  EXPECT_EQ(l.source, "rope");
  EXPECT_EQ(l.kernel, "rope_gptj_bfloat16_int32");
  EXPECT_EQ(l.grid, (std::array<uint32_t, 3>{37, 1, 1}));
  EXPECT_EQ(l.threadgroup, (std::array<uint32_t, 3>{20, 9, 1}));  // 20 pairs x 9 heads
  ASSERT_EQ(l.buffers.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(l.buffers[i].index, i);
    EXPECT_EQ(l.buffers[i].array_slot, i);
  }
  EXPECT_EQ(l.args_index, 4);
  RopeArgs a = args_of(l);
  EXPECT_EQ(a.x_token_stride, 1200);
  EXPECT_EQ(a.x_head_stride, 80);
  EXPECT_EQ(a.x_dim_stride, 1);
  EXPECT_EQ(a.out_token_stride, 9 * 80);
  EXPECT_EQ(a.num_heads, 9u);
  EXPECT_EQ(a.head_size, 80u);
  EXPECT_EQ(a.rotary_half, 20u);
  EXPECT_FLOAT_EQ(a.mscale, 1.5f);
}

TEST(RopePlanner, ThreadgroupsStayWithinLimits) {
  vm::RopeProblem p;
  for (int64_t heads : {1, 3, 32, 128}) {
    for (int64_t rot : {2, 16, 64, 128, 256, 512}) {
      p.heads = heads;
      p.head_size = rot;
      p.rotary_dim = rot;
      p.tokens = 3;
      const auto& l = vm::plan_rope(p)[0];
      const uint64_t threads = uint64_t(l.threadgroup[0]) * l.threadgroup[1];
      EXPECT_GE(threads, 1u);
      EXPECT_LE(threads, 256u);
      EXPECT_LE(l.threadgroup[0], std::max<uint32_t>(1, rot / 2));
      EXPECT_LE(l.threadgroup[1], heads);
    }
  }
}

TEST(RopePlanner, KernelNamesCoverEveryVariant) {
  std::set<std::string> names;
  for (auto dt : {mx::float32, mx::float16, mx::bfloat16}) {
    for (auto pt : {mx::int32, mx::int64}) {
      for (bool neox : {true, false}) names.insert(vm::rope_kernel_name(dt, pt, neox));
    }
  }
  EXPECT_EQ(names.size(), 12u);
  EXPECT_TRUE(names.count("rope_neox_float16_int64"));
}

TEST(RopeScaling, ParsesHfDicts) {
  auto s = vm::parse_rope_scaling({{"rope_type", std::string("llama3")},
                                   {"factor", 8.0},
                                   {"low_freq_factor", 1.0},
                                   {"high_freq_factor", 4.0},
                                   {"original_max_position_embeddings", 8192.0}});
  EXPECT_EQ(s.type, vm::RopeScalingType::kLlama3);
  EXPECT_EQ(s.factor, 8.0);
  s = vm::parse_rope_scaling({{"type", std::string("yarn")},
                              {"factor", 4.0},
                              {"original_max_position_embeddings", 32768.0},
                              {"mscale", std::monostate{}},
                              {"truncate", 0.0}});
  EXPECT_EQ(s.type, vm::RopeScalingType::kYarn);
  EXPECT_FALSE(s.mscale.has_value());
  EXPECT_FALSE(s.truncate);
  EXPECT_EQ(vm::parse_rope_scaling({}).type, vm::RopeScalingType::kDefault);
  EXPECT_EQ(vm::parse_rope_scaling({{"rope_type", std::string("default")}}).type,
            vm::RopeScalingType::kDefault);
}

TEST(RopeScaling, RejectsWhatItCannotHonour) {
  using C = vm::RopeScalingConfig;
  expect_rope_error([] { vm::parse_rope_scaling(C{{"rope_type", std::string("longrope")}}); },
                    "unsupported scaling type 'longrope'");
  expect_rope_error([] { vm::parse_rope_scaling(C{{"factor", 2.0}}); }, "needs a 'rope_type'");
  expect_rope_error(
      [] { vm::parse_rope_scaling(C{{"rope_type", std::string("linear")}, {"factr", 2.0}}); },
      "linear scaling requires 'factor'");
  expect_rope_error(
      [] {
        vm::parse_rope_scaling(
            C{{"rope_type", std::string("linear")}, {"factor", 2.0}, {"mrope_section", 1.0}});
      },
      "unknown key 'mrope_section'");
  expect_rope_error(
      [] {
        vm::parse_rope_scaling(C{{"rope_type", std::string("yarn")},
                                 {"factor", -4.0},
                                 {"original_max_position_embeddings", 4096.0}});
      },
      "factor must be finite and > 0");
  expect_rope_error([] { vm::rope_frequencies(7, 10000.0, {}); }, "rotary_dim must be even");
  expect_rope_error([] { vm::rope_frequencies(8, NAN, {}); }, "base must be finite");
  vm::RopeScaling yarn;
  yarn.type = vm::RopeScalingType::kYarn;
  expect_rope_error([&] { vm::rope_frequencies(8, 1.0, yarn); }, "yarn scaling needs base > 1");
}

TEST(RopeScaling, FrequenciesFollowTheirDefinitions) {
  auto f = vm::rope_frequencies(4, 10000.0, {});
  ASSERT_EQ(f.inv_freq.size(), 2u);
  EXPECT_DOUBLE_EQ(f.inv_freq[0], 1.0);
  EXPECT_DOUBLE_EQ(f.inv_freq[1], 0.01);
  EXPECT_EQ(f.mscale, 1.0);

  vm::RopeScaling linear;
  linear.type = vm::RopeScalingType::kLinear;
  linear.factor = 2.0;
  EXPECT_DOUBLE_EQ(vm::rope_frequencies(4, 10000.0, linear).inv_freq[1], 0.005);

  // llama3: wavelengths below L/high kept, above L/low divided by factor
  vm::RopeScaling l3;
  l3.type = vm::RopeScalingType::kLlama3;
  l3.factor = 8.0;
  auto plain = vm::rope_frequencies(128, 500000.0, {}).inv_freq;
  auto scaled = vm::rope_frequencies(128, 500000.0, l3).inv_freq;
  int kept = 0, divided = 0, blended = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    const double wavelen = 2 * kPi / plain[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_EQ(scaled[i], plain[i]);
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_DOUBLE_EQ(scaled[i], plain[i] / 8);
      ++divided;
    } else {
      EXPECT_LT(scaled[i], plain[i]);
      EXPECT_GT(scaled[i], plain[i] / 8);
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);

  // yarn: the fastest pair extrapolates, the slowest interpolates; mscale
  vm::RopeScaling yarn;
  yarn.type = vm::RopeScalingType::kYarn;
  yarn.factor = 40.0;
  yarn.original_max_position_embeddings = 4096;
  auto y = vm::rope_frequencies(128, 10000.0, yarn);
  plain = vm::rope_frequencies(128, 10000.0, {}).inv_freq;
  EXPECT_EQ(y.inv_freq.front(), plain.front());
  EXPECT_DOUBLE_EQ(y.inv_freq.back(), plain.back() / 40);
  EXPECT_DOUBLE_EQ(y.mscale, 0.1 * std::log(40.0) + 1.0);
  yarn.mscale = 1.0;
  yarn.mscale_all_dim = 1.0;  // DeepSeek-V3: the ratio cancels
  EXPECT_DOUBLE_EQ(vm::rope_frequencies(128, 10000.0, yarn).mscale, 1.0);
  yarn.attention_factor = 0.8;
  yarn.attn_factor = 0.5;
  EXPECT_DOUBLE_EQ(vm::rope_frequencies(128, 10000.0, yarn).mscale, 0.4);
}

TEST(RopeTable, IsCachedPerConfiguration) {
  vm::RopeScaling s;
  auto a = vm::rope_table(64, 10000.0, s);
  auto b = vm::rope_table(64, 10000.0, s);
  EXPECT_EQ(a.table.data<uint32_t>(), b.table.data<uint32_t>());
  EXPECT_EQ(a.table.shape(), (mx::Shape{2, 32}));
  EXPECT_EQ(a.table.dtype(), mx::uint32);
  s.type = vm::RopeScalingType::kLinear;
  s.factor = 2.0;
  auto c = vm::rope_table(64, 10000.0, s);
  EXPECT_NE(a.table.data<uint32_t>(), c.table.data<uint32_t>());
  // rate halves: the high word of pair 0 (1 / 2pi turns) halves too
  EXPECT_EQ(c.table.data<uint32_t>()[32], a.table.data<uint32_t>()[32] / 2);
}
