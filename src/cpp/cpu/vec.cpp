#include "cpu/vec.h"

namespace vllm_metal::cpu {

bool has_avx2_fma() {
#if defined(__x86_64__)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

}  // namespace vllm_metal::cpu
