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

namespace {

// Scalar tails (and whole arrays where no vector path exists).
template <Elt E>
void to_floats_from(const typename EltTraits<E>::Storage* s, int64_t i, int64_t n, float* d) {
  for (; i < n; ++i) d[i] = EltTraits<E>::load(s + i);
}
template <Elt E>
void from_floats_from(const float* s, int64_t i, int64_t n, typename EltTraits<E>::Storage* d) {
  for (; i < n; ++i) EltTraits<E>::store(d + i, s[i]);
}

#if defined(__x86_64__)
template <Elt E>
VLLM_METAL_AVX2 int64_t to_floats_avx2(const typename EltTraits<E>::Storage* s, int64_t n,
                                       float* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, load8<E>(s + i));
  return i;
}
template <Elt E>
VLLM_METAL_AVX2 int64_t from_floats_avx2(const float* s, int64_t n,
                                         typename EltTraits<E>::Storage* d) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8<E>(d + i, _mm256_loadu_ps(s + i));
  return i;
}
#endif

template <Elt E>
void to_floats_typed(const void* src, int64_t n, float* dst) {
  auto* s = static_cast<const typename EltTraits<E>::Storage*>(src);
  int64_t i = 0;
#if defined(__x86_64__)
  if (has_avx2_fma()) i = to_floats_avx2<E>(s, n, dst);
#elif defined(__aarch64__)
  for (; i + 4 <= n; i += 4) vst1q_f32(dst + i, load4<E>(s + i));
#endif
  to_floats_from<E>(s, i, n, dst);
}

template <Elt E>
void from_floats_typed(const float* src, int64_t n, void* dst) {
  auto* d = static_cast<typename EltTraits<E>::Storage*>(dst);
  int64_t i = 0;
#if defined(__x86_64__)
  if (has_avx2_fma()) i = from_floats_avx2<E>(src, n, d);
#elif defined(__aarch64__)
  for (; i + 4 <= n; i += 4) store4<E>(d + i, vld1q_f32(src + i));
#endif
  from_floats_from<E>(src, i, n, d);
}

}  // namespace

void to_floats(Elt elt, const void* src, int64_t n, float* dst) {
  switch (elt) {
    case Elt::kF32: std::memcpy(dst, src, n * sizeof(float)); return;
    case Elt::kF16: return to_floats_typed<Elt::kF16>(src, n, dst);
    case Elt::kBF16: return to_floats_typed<Elt::kBF16>(src, n, dst);
  }
}

void from_floats(Elt elt, const float* src, int64_t n, void* dst) {
  switch (elt) {
    case Elt::kF32: std::memcpy(dst, src, n * sizeof(float)); return;
    case Elt::kF16: return from_floats_typed<Elt::kF16>(src, n, dst);
    case Elt::kBF16: return from_floats_typed<Elt::kBF16>(src, n, dst);
  }
}

}  // namespace vllm_metal::cpu
