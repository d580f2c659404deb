#include <gtest/gtest.h>

#include "ops/kernel_launch.h"

namespace vm = vllm_metal;

TEST(KernelLaunch, ArgsAreCopiedAsBytes) {
  struct Args {
    int64_t a;
    float b;
  } args{7, 2.5f};
  vm::KernelLaunch l;
  l.set_args(3, args);
  ASSERT_EQ(l.args.size(), sizeof(Args));
  EXPECT_EQ(l.args_index, 3);
  Args back;
  std::memcpy(&back, l.args.data(), sizeof(Args));
  EXPECT_EQ(back.a, 7);
  EXPECT_EQ(back.b, 2.5f);
}

TEST(KernelLaunch, FunctionConstantsKeepTheirBits) {
  auto f = vm::FunctionConstant::float32(2, -1.5f);
  float v;
  std::memcpy(&v, &f.bits, 4);
  EXPECT_EQ(v, -1.5f);
  EXPECT_EQ(f.byte_size(), 4u);
  auto b = vm::FunctionConstant::boolean(0, true);
  EXPECT_EQ(b.bits, 1u);
  EXPECT_EQ(b.byte_size(), 1u);
  EXPECT_EQ(vm::FunctionConstant::int32(1, -3).bits, 0xfffffffdu);
}

TEST(KernelLaunch, NumThreadsMultipliesGridAndThreadgroup) {
  vm::KernelLaunch l;
  l.grid = {3, 2, 1};
  l.threadgroup = {33, 1, 2};
  EXPECT_EQ(l.num_threads(), 3u * 2 * 33 * 2);
  EXPECT_EQ(vm::ceil_div(65, 32), 3u);
}
