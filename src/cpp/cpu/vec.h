// Element conversions and 8-wide float vectors for the CPU kernels.
//
// Kernels see float16/bfloat16 as raw uint16_t bits and compute in float32.
// The x86-64 helpers carry target attributes so one binary runs everywhere;
// callers choose them at run time with has_avx2_fma().
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace vllm_metal::cpu {

enum class Elt { kF32, kF16, kBF16 };

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000 | (man << 13));  // inf / nan
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

// Round to nearest even, like the hardware conversions MLX uses.
inline uint16_t float_to_f16(float f) {
  uint32_t x = float_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  uint32_t ax = x & 0x7fffffff;
  if (ax >= 0x7f800000) return sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0);
  if (ax >= 0x477ff000) return sign | 0x7c00;  // rounds past 65504 -> inf
  if (ax < 0x38800000) {
    // result is subnormal (or zero): scale so the integer part is the mantissa
    float v = bits_to_float(ax) * 16777216.0f;  // 2^24
    return sign | static_cast<uint16_t>(std::nearbyint(v));
  }
  uint32_t mant_odd = (ax >> 13) & 1;
  ax += 0xfff + mant_odd;
  return sign | static_cast<uint16_t>(((ax >> 13) - (112u << 10)) & 0x7fff);
}

inline float bf16_to_float(uint16_t h) {
  return bits_to_float(uint32_t(h) << 16);
}
inline uint16_t float_to_bf16(float f) {
  uint32_t x = float_to_bits(f);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

template <Elt E>
struct EltTraits;
template <>
struct EltTraits<Elt::kF32> {
  using Storage = float;
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
};
template <>
struct EltTraits<Elt::kF16> {
  using Storage = uint16_t;
  static float load(const uint16_t* p) { return f16_to_float(*p); }
  static void store(uint16_t* p, float v) { *p = float_to_f16(v); }
};
template <>
struct EltTraits<Elt::kBF16> {
  using Storage = uint16_t;
  static float load(const uint16_t* p) { return bf16_to_float(*p); }
  static void store(uint16_t* p, float v) { *p = float_to_bf16(v); }
};

// Rounds v to the precision of E and back (what a store + load would give).
template <Elt E>
inline float round_to(float v) {
  typename EltTraits<E>::Storage s;
  EltTraits<E>::store(&s, v);
  return EltTraits<E>::load(&s);
}

bool has_avx2_fma();

// dst[0, n) = src[0, n) as float32 / src converted to elt (round to nearest even); vectorized
// where the machine allows, so activations crossing a float32 kernel cost little.
void to_floats(Elt elt, const void* src, int64_t n, float* dst);
void from_floats(Elt elt, const float* src, int64_t n, void* dst);

// Asks for the cache lines of [p, p + bytes) ahead of use (a hint: never faults).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o);
}

#if defined(__x86_64__)
#define VLLM_METAL_AVX2 __attribute__((target("avx2,fma,f16c")))

template <Elt E>
VLLM_METAL_AVX2 inline __m256 load8(const typename EltTraits<E>::Storage* p) {
  if constexpr (E == Elt::kF32) {
    return _mm256_loadu_ps(p);
  } else if constexpr (E == Elt::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
}

template <Elt E>
VLLM_METAL_AVX2 inline void store8(typename EltTraits<E>::Storage* p, __m256 v) {
  if constexpr (E == Elt::kF32) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (E == Elt::kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    // round to nearest even on the upper 16 bits; NaN lanes keep a quiet NaN
    __m256i x = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    __m256i qnan = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));
    r = _mm256_srli_epi32(_mm256_blendv_epi8(r, qnan, nan), 16);
    // pack 8 x u32 (< 2^16) into 8 x u16 in order
    __m128i lo = _mm256_castsi256_si128(r);
    __m128i hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(lo, hi));
  }
}

VLLM_METAL_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
  return _mm_cvtss_f32(s);
}
#endif  // __x86_64__

#if defined(__aarch64__)
template <Elt E>
inline float32x4_t load4(const typename EltTraits<E>::Storage* p) {
  if constexpr (E == Elt::kF32) {
    return vld1q_f32(p);
  } else if constexpr (E == Elt::kF16) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  } else {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
}

template <Elt E>
inline void store4(typename EltTraits<E>::Storage* p, float32x4_t v) {
  if constexpr (E == Elt::kF32) {
    vst1q_f32(p, v);
  } else if constexpr (E == Elt::kF16) {
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v)));  // FPCR default: nearest even
  } else {
    // round to nearest even on the upper 16 bits; NaN lanes keep a quiet NaN
    uint32x4_t x = vreinterpretq_u32_f32(v);
    uint32x4_t odd = vandq_u32(vshrq_n_u32(x, 16), vdupq_n_u32(1));
    uint32x4_t r = vaddq_u32(x, vaddq_u32(odd, vdupq_n_u32(0x7fff)));
    uint32x4_t is_num = vceqq_f32(v, v);
    uint32x4_t qnan = vorrq_u32(x, vdupq_n_u32(0x400000));
    vst1_u16(p, vshrn_n_u32(vbslq_u32(is_num, r, qnan), 16));
  }
}
#endif  // __aarch64__

}  // namespace vllm_metal::cpu
