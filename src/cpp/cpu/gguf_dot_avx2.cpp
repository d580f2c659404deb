// The GGUF matmul kernels for AVX2 + FMA + F16C (gguf_dot_x86.h, maddubs dots).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "cpu/gguf_kernels.h"
#include "cpu/vec.h"

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace vllm_metal::cpu {

#define GGUF_X86_VNNI 0
#define GGUF_X86_AVX512 0
#include "cpu/gguf_dot_x86.h"
#undef GGUF_X86_VNNI
#undef GGUF_X86_AVX512

const GgufKernels& gguf_kernels_avx2() {
  static const GgufKernels t = make_x86_kernels("avx2");
  return t;
}

}  // namespace vllm_metal::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // __x86_64__
