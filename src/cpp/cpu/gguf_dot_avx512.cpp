// The GGUF matmul kernels for AVX-512 (F, BW, VL, DQ) with VNNI: gguf_dot_x86.h
// with dpbusd integer dots on 256-bit vectors and 512-bit prefill panels.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/gguf_kernels.h"
#include "cpu/vec.h"

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(                                                                  \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif

namespace vllm_metal::cpu {

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports the undefined pass-through operand inside its own 512-bit intrinsics
// (_mm512_undefined_*) as maybe-uninitialized wherever they are inlined.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define GGUF_X86_VNNI 1
#define GGUF_X86_AVX512 1
#include "cpu/gguf_dot_x86.h"
#undef GGUF_X86_VNNI
#undef GGUF_X86_AVX512
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

const GgufKernels& gguf_kernels_avx512() {
  static const GgufKernels t = make_x86_kernels("avx512");
  return t;
}

}  // namespace vllm_metal::cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // __x86_64__
