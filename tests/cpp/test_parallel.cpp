#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "cpu/parallel.h"

namespace c = vllm_metal::cpu;

TEST(Parallel, EveryIndexExactlyOnce) {
  for (int threads : {1, 2, 3}) {
    c::set_num_threads(threads);
    for (int64_t n : {0, 1, 2, 7, 64, 1000, 4097}) {
      for (int64_t grain : {1, 3, 100, 5000}) {
        std::vector<std::atomic<int>> hits(n);
        c::parallel_for(n, grain, [&](int64_t b, int64_t e) {
          ASSERT_LE(0, b);
          ASSERT_LE(b, e);
          ASSERT_LE(e, n);
          for (int64_t i = b; i < e; ++i) hits[i]++;
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << n << "/" << grain;
      }
    }
  }
  c::set_num_threads(0);
}

TEST(Parallel, NestedCallsRunInline) {
  c::set_num_threads(2);
  std::atomic<int64_t> total{0};
  c::parallel_for(8, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      c::parallel_for(100, 1, [&](int64_t b2, int64_t e2) { total += e2 - b2; });
    }
  });
  EXPECT_EQ(total.load(), 800);
  c::set_num_threads(0);
}

TEST(Parallel, ConcurrentCallersEachGetEveryIndex) {
  // The pool serves one caller at a time; the others run inline. Every caller must still
  // see each of its indices exactly once (ThreadSanitizer runs this: test_runtime_tsan.py).
  c::set_num_threads(2);
  std::vector<std::thread> callers;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      for (int rep = 0; rep < 200; ++rep) {
        const int64_t n = 17 + 31 * t + rep % 7;
        std::vector<std::atomic<int>> hits(n);
        c::parallel_for(n, 1 + rep % 3, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) hits[i]++;
        });
        for (int64_t i = 0; i < n; ++i) wrong += hits[i].load() != 1;
      }
    });
  }
  for (auto& th : callers) th.join();
  EXPECT_EQ(wrong.load(), 0);
  c::set_num_threads(0);
}
