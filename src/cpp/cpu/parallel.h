// A small persistent thread pool for the CPU kernels.
//
// MLX's Linux CPU backend runs each op on one stream thread; our kernels split
// their work across this pool. Nested or concurrent calls run inline instead
// of waiting, so a kernel can never deadlock on the pool.
#pragma once

#include <cstdint>
#include <functional>

namespace vllm_metal::cpu {

// Calls fn(begin, end) over [0, n) in chunks of at least `grain` items.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

int num_threads();
// 0 = hardware concurrency. Takes effect for the next parallel_for.
void set_num_threads(int n);

}  // namespace vllm_metal::cpu
