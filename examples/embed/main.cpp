// Embeds the vllm-metal core in a native program: builds MLX arrays, writes
// two tokens into a paged KV cache, normalizes a hidden state, checks both.
#include <cmath>
#include <cstdio>
#include <vector>

#include "mlx/mlx.h"
#include "ops/reshape_and_cache.h"
#include "ops/rms_norm.h"

namespace mx = mlx::core;
namespace vm = vllm_metal;

int main() {
  // rms_norm of one row [1, 2, 3, 4] with unit weight
  mx::array x({1.0f, 2.0f, 3.0f, 4.0f}, {1, 4});
  mx::array y = vm::rms_norm(x, mx::ones({4}), 0.0f, mx::Device::cpu);
  mx::eval(y);
  const float rms = std::sqrt((1 + 4 + 9 + 16) / 4.0f);
  float max_err = 0;
  for (int i = 0; i < 4; ++i) {
    max_err = std::fmax(max_err, std::fabs(y.data<float>()[i] - (i + 1) / rms));
  }

  // a cache of 2 blocks x 4 slots, 1 head of size 8; tokens go to slots 5 and 2
  mx::array key = mx::reshape(mx::arange(16, mx::float32), {2, 1, 8});
  mx::array cache = mx::zeros({2, 4, 1, 8}, mx::float32);
  mx::array slots(std::vector<int64_t>{5, 2}.data(), {2}, mx::int64);
  auto caches =
      vm::reshape_and_cache(key, key, cache, cache, slots, /*inplace=*/false, mx::Device::cpu);
  mx::eval(caches);
  const float* kc = caches[0].data<float>();
  bool cache_ok = kc[5 * 8 + 3] == 3.0f && kc[2 * 8 + 3] == 11.0f && kc[0] == 0.0f;

  std::printf("rms_norm max error %.2e, cache %s\n", max_err, cache_ok ? "ok" : "WRONG");
  return (max_err < 1e-6f && cache_ok) ? 0 : 1;
}
