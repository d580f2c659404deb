// Planners are pure: launch geometry and argument packing tested with no device.
#include <gtest/gtest.h>

#include <cstring>

#include "ops/reshape_and_cache.h"
#include "ops/rms_norm.h"
#include "reshape_and_cache_args.h"
#include "rms_norm_args.h"

namespace vm = vllm_metal;
namespace mx = mlx::core;

TEST(RmsNormPlanner, OneThreadgroupPerRowWithPackedArgs) {
  vm::RmsNormProblem p;
  p.dtype = mx::bfloat16;
  p.rows = 9;
  p.hidden = 576;
  p.x_row_stride = 1000;
  p.residual_row_stride = 576;
  p.fused_add = true;
  p.eps = 1e-6f;
  auto plan = vm::plan_rms_norm(p);
  ASSERT_EQ(plan.size(), 1u);
  const auto& l = plan[0];
  EXPECT_EQ(l.source, "rms_norm");
  EXPECT_EQ(l.kernel, "add_rms_norm_bfloat16");
  EXPECT_EQ(l.grid[0], 9u);
  EXPECT_EQ(l.threadgroup[0] % 32, 0u);
  EXPECT_LE(l.threadgroup[0], 1024u);
  EXPECT_GE(l.threadgroup[0] * 4, 576u);
  ASSERT_EQ(l.buffers.size(), 5u);
  EXPECT_EQ(l.args_index, 5);
  RmsNormArgs args;
  ASSERT_EQ(l.args.size(), sizeof(args));
  std::memcpy(&args, l.args.data(), sizeof(args));
  EXPECT_EQ(args.x_row_stride, 1000);
  EXPECT_EQ(args.out_row_stride, 576);
  EXPECT_EQ(args.hidden, 576u);
  EXPECT_FLOAT_EQ(args.eps, 1e-6f);
}

TEST(CacheWritePlanner, CopiesFirstOnlyWhenTheCacheIsNotReused) {
  vm::CacheWriteProblem p;
  p.dtype = mx::float16;
  p.num_tokens = 5;
  p.num_heads = 3;
  p.head_size = 64;
  p.num_slots = 48;
  auto plan = vm::plan_cache_write(p);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].kernel, "cache_write_float16");
  EXPECT_EQ(plan[0].grid[0], 5u);
  p.copy_cache = true;
  plan = vm::plan_cache_write(p);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].kernel, "cache_copy_float16");
  CacheCopyArgs c;
  std::memcpy(&c, plan[0].args.data(), sizeof(c));
  EXPECT_EQ(c.num_elements, 48u * 3 * 64);
  EXPECT_GE(uint64_t(plan[0].grid[0]) * plan[0].threadgroup[0], c.num_elements);
  CacheWriteArgs a;
  std::memcpy(&a, plan[1].args.data(), sizeof(a));
  EXPECT_EQ(a.num_slots, 48);
  EXPECT_EQ(a.num_heads, 3u);
}
