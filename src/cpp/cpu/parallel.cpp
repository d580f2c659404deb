#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "cpu/gguf_pool.h"

namespace vllm_metal::cpu {

namespace {

int hardware_threads() {
  // glibc answers hardware_concurrency() by reading /sys on every call (~6 us)
  static const int n = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return n;
}

std::atomic<int> g_requested{0};

}  // namespace

int num_threads() {
  int n = g_requested.load();
  return n > 0 ? n : hardware_threads();
}

void set_num_threads(int n) {
  g_requested.store(std::max(0, n));
}

// One pool for every kernel: the spinning pool of gguf_pool.h. (A second pool woke its
// worker through a condition variable per call, and its worker and the spinning one
// took turns on the cores.)
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  gguf_parallel_for(n, grain, fn);
}

}  // namespace vllm_metal::cpu
