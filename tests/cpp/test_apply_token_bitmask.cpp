// apply_token_bitmask: the planner's geometry and args, and the CPU kernel on raw
// bits against a per-token reference, out of place and in place.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "apply_token_bitmask_args.h"
#include "cpu/apply_token_bitmask.h"
#include "ops/apply_token_bitmask.h"

namespace vm = vllm_metal;
namespace c = vllm_metal::cpu;
namespace mx = mlx::core;

TEST(TokenBitmaskPlanner, SpansOfTheRowByRows) {
  vm::TokenBitmaskProblem p;
  p.dtype = mx::bfloat16;
  p.num_rows = 5;
  p.vocab = 49152;
  p.mask_words = 1540;
  p.in_place = true;
  auto plan = vm::plan_apply_token_bitmask(p);
  ASSERT_EQ(plan.size(), 1u);
  const auto& l = plan[0];
  EXPECT_EQ(l.source, "apply_token_bitmask");
  EXPECT_EQ(l.kernel, "apply_token_bitmask_bfloat16");
  EXPECT_EQ(l.grid[0], 6u);  // 48 spans of 1024 tokens, 8 per threadgroup
  EXPECT_EQ(l.grid[1], 5u);
  EXPECT_EQ(l.threadgroup[0], 256u);
  ASSERT_EQ(l.buffers.size(), 4u);
  EXPECT_EQ(l.args_index, 4);
  TokenBitmaskArgs args;
  ASSERT_EQ(l.args.size(), sizeof(args));
  std::memcpy(&args, l.args.data(), sizeof(args));
  EXPECT_EQ(args.logits_row_stride, 49152);
  EXPECT_EQ(args.out_row_stride, 49152);
  EXPECT_EQ(args.mask_row_stride, 1540);
  EXPECT_EQ(args.vocab, 49152u);
  EXPECT_EQ(args.in_place, 1u);
  // a short row: one simdgroup, one threadgroup
  p.vocab = 100;
  p.mask_words = 4;
  EXPECT_EQ(vm::plan_apply_token_bitmask(p)[0].threadgroup[0], 32u);
  EXPECT_EQ(vm::plan_apply_token_bitmask(p)[0].grid[0], 1u);
}

namespace {

template <typename B>
void check_cpu(c::Elt elt, B neg_inf, int64_t num_rows, int64_t vocab, int64_t extra_words,
               std::vector<int32_t> rows, bool in_place) {
  std::mt19937 rng(static_cast<uint32_t>(vocab * 7 + num_rows));
  const int64_t words = (vocab + 31) / 32 + extra_words;
  std::vector<B> x(num_rows * vocab);
  for (auto& v : x) v = static_cast<B>(rng() & 0x3fffffffu);
  std::vector<uint32_t> mask(rows.size() * words);
  for (size_t i = 0; i < mask.size(); ++i) {
    switch (i % 5) {  // all three word paths: ones, zeros, mixed
      case 0: mask[i] = 0xffffffffu; break;
      case 1: mask[i] = 0; break;
      default: mask[i] = rng();
    }
  }
  std::vector<int32_t> inverse(num_rows, -1);
  for (size_t i = 0; i < rows.size(); ++i) inverse[rows[i]] = static_cast<int32_t>(i);
  std::vector<B> y = in_place ? x : std::vector<B>(x.size(), B(0x1234));
  c::TokenBitmaskRows a;
  a.elt = elt;
  a.logits = in_place ? y.data() : x.data();
  a.out = y.data();
  a.bitmask = mask.data();
  a.mask_of_row = inverse.data();
  a.num_rows = num_rows;
  a.vocab = vocab;
  a.mask_words = words;
  c::apply_token_bitmask_rows(a);
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t t = 0; t < vocab; ++t) {
      B want = x[r * vocab + t];
      const int32_t m = inverse[r];
      if (m >= 0 && ((mask[m * words + t / 32] >> (t % 32)) & 1u) == 0) want = neg_inf;
      ASSERT_EQ(y[r * vocab + t], want) << "row " << r << " token " << t;
    }
  }
}

}  // namespace

TEST(TokenBitmaskCpu, MatchesThePerTokenRuleOutOfPlaceAndInPlace) {
  for (bool in_place : {false, true}) {
    check_cpu<uint32_t>(c::Elt::kF32, 0xff800000u, 4, 1000, 2, {3, 0}, in_place);
    check_cpu<uint16_t>(c::Elt::kF16, 0xfc00u, 3, 33, 0, {1, 2, 0}, in_place);
    check_cpu<uint16_t>(c::Elt::kBF16, 0xff80u, 2, 1, 0, {1}, in_place);
    check_cpu<uint16_t>(c::Elt::kBF16, 0xff80u, 300, 257, 0, {7, 299, 150}, in_place);
    // rows in pieces of 16384 tokens, the last one partial and not a multiple of 32
    check_cpu<uint32_t>(c::Elt::kF32, 0xff800000u, 3, 40001, 1, {2, 0}, in_place);
  }
}
