#include "cpu/gguf_quants.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/gguf_kernels.h"
#include "cpu/parallel.h"
#include "gguf_tables.h"

// Bit-exactness needs each product rounded before the following add/sub, as
// the NumPy reference does: no contraction into fused multiply-adds here. On
// x86-64 these functions are compiled without FMA, so nothing can contract;
// clang contracts only within one expression (the decoders keep products and
// sums in separate statements); GCC on arm64 needs the pragma. (GCC's optimize
// pragma costs speed, so it is used only where it is needed.)
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__) && defined(__aarch64__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace vllm_metal::cpu {

namespace {

using gguf::GGMLType;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}
inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- legacy 32-weight blocks ----------------------------------------------
// Weight j < 16 is the low nibble of qs[j], weight j + 16 its high nibble.

void decode_q4_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((qs[j] & 0xF) - 8);
    y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
  }
}

void decode_q4_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    float lo = d * static_cast<float>(qs[j] & 0xF);
    float hi = d * static_cast<float>(qs[j] >> 4);
    y[j] = lo + m;
    y[j + 16] = hi + m;
  }
}

void decode_q5_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint32_t qh = u32_at(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
    int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo - 16);
    y[j + 16] = d * static_cast<float>(hi - 16);
  }
}

void decode_q5_1(const uint8_t* b, float* y) {
  const float d = half_at(b), m = half_at(b + 2);
  const uint32_t qh = u32_at(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
    int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    float a = d * static_cast<float>(lo);
    float c = d * static_cast<float>(hi);
    y[j] = a + m;
    y[j + 16] = c + m;
  }
}

void decode_q8_0(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void decode_iq4_nl(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kGgufIq4nlValues[qs[j] & 0xF]);
    y[j + 16] = d * static_cast<float>(kGgufIq4nlValues[qs[j] >> 4]);
  }
}

// block_mxfp4 (gpt-oss): one E8M0 exponent byte e, then 16 bytes of E2M1 nibbles; weight j
// is the low nibble of byte j, weight j + 16 its high nibble. Scale 2^(e - 128) times the
// doubled E2M1 value = 2^(e - 127) times the value.
// 2^(e - 128) is built from its bits (gguf_e8m0_half: std::ldexp per block was most of the
// decode's time).

void decode_mxfp4(const uint8_t* b, float* y) {
  const float d = gguf_e8m0_half(b[0]);
  const uint8_t* qs = b + 1;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(kGgufMxfp4Values[qs[j] & 0xF]);
    y[j + 16] = d * static_cast<float>(kGgufMxfp4Values[qs[j] >> 4]);
  }
}

// ---- K quants: 256-weight super-blocks ------------------------------------

// block_q2_K: scales[16] (lo nibble scale, hi nibble min), qs[64], d, dmin.
// Weight i = 128h + 32s + l is (qs[32h + l] >> 2s) & 3, in sub-block i / 16.
void decode_q2_k(const uint8_t* b, float* y) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int i = 0; i < 256; ++i) {
    int h = i >> 7, s = (i >> 5) & 3, l = i & 31;
    int q = (qs[32 * h + l] >> (2 * s)) & 3;
    uint8_t sub = sc[i >> 4];
    float dl = d * static_cast<float>(sub & 0xF);
    float ml = dmin * static_cast<float>(sub >> 4);
    float t = dl * static_cast<float>(q);
    y[i] = t - ml;
  }
}

// block_q3_K: hmask[32], qs[64], scales[12] (16 x 6 bits), d.
void decode_q3_k(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = half_at(b + 108);
  float dl[16];
  for (int i = 0; i < 16; ++i) {
    int lo = (i < 8 ? sc[i] : sc[i - 8] >> 4) & 0xF;
    int hi = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    dl[i] = d * static_cast<float>((lo | (hi << 4)) - 32);
  }
  for (int i = 0; i < 256; ++i) {
    int h = i >> 7, s = (i >> 5) & 3, l = i & 31;
    int ql = (qs[32 * h + l] >> (2 * s)) & 3;
    int hb = (hmask[l] >> (i >> 5)) & 1;
    y[i] = dl[i >> 4] * static_cast<float>(ql - (hb ? 0 : 4));
  }
}

// The 8 six-bit (scale, min) pairs of Q4_K / Q5_K.
inline void k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 2) & 0x30);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// block_q4_K: d, dmin, scales[12], qs[128]. Sub-block j = 2c + s holds
// (qs[32c + l] >> 4s) & 0xF.
void decode_q4_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(scales, j, &sc, &mn);
    float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
    int c = j >> 1, sh = 4 * (j & 1);
    for (int l = 0; l < 32; ++l) {
      float t = dj * static_cast<float>((qs[32 * c + l] >> sh) & 0xF);
      y[32 * j + l] = t - mj;
    }
  }
}

// block_q5_K: d, dmin, scales[12], qh[32], qs[128]; bit j of qh[l] is the
// fifth bit of weight l of sub-block j.
void decode_q5_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(scales, j, &sc, &mn);
    float dj = d * static_cast<float>(sc), mj = dmin * static_cast<float>(mn);
    int c = j >> 1, sh = 4 * (j & 1);
    for (int l = 0; l < 32; ++l) {
      int q = ((qs[32 * c + l] >> sh) & 0xF) | (((qh[l] >> j) & 1) << 4);
      float t = dj * static_cast<float>(q);
      y[32 * j + l] = t - mj;
    }
  }
}

// block_q6_K: ql[128], qh[64], scales[16] (int8), d. Weight i = 128h + 32s + l:
// low 4 bits (ql[64h + 32(s&1) + l] >> 4(s>>1)), high 2 bits (qh[32h + l] >> 2s).
void decode_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int i = 0; i < 256; ++i) {
    int h = i >> 7, s = (i >> 5) & 3, l = i & 31;
    int lo = (ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0xF;
    int hi = (qh[32 * h + l] >> (2 * s)) & 3;
    float ds = d * static_cast<float>(sc[i >> 4]);
    y[i] = ds * static_cast<float>((lo | (hi << 4)) - 32);
  }
}

// ---- IQ quants -------------------------------------------------------------

// block_iq4_xs: d, scales_h (u16), scales_l[4], qs[128].
void decode_iq4_xs(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint16_t sh = static_cast<uint16_t>(b[2] | (b[3] << 8));
  const uint8_t* sl = b + 4;
  const uint8_t* qs = b + 8;
  for (int ib = 0; ib < 8; ++ib) {
    int lo = (sl[ib >> 1] >> (4 * (ib & 1))) & 0xF;
    int hi = (sh >> (2 * ib)) & 3;
    float dl = d * static_cast<float>((lo | (hi << 4)) - 32);
    for (int l = 0; l < 16; ++l) {
      uint8_t q = qs[16 * ib + l];
      y[32 * ib + l] = dl * static_cast<float>(kGgufIq4nlValues[q & 0xF]);
      y[32 * ib + 16 + l] = dl * static_cast<float>(kGgufIq4nlValues[q >> 4]);
    }
  }
}

inline float grid_byte(uint32_t g, int e) { return static_cast<float>((g >> (8 * e)) & 0xFF); }

// block_iq3_xxs: d, qs[64] (grid indices), 8 x u32 (4 x 7 sign bits, 4-bit scale).
// The 8th sign of each group of 8 is the parity of the other 7.
void decode_iq3_xxs(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  for (int ib = 0; ib < 8; ++ib) {
    uint32_t aux = u32_at(b + 66 + 4 * ib);
    float t = d * (0.5f + static_cast<float>(aux >> 28));
    float db = t * 0.5f;
    for (int k = 0; k < 4; ++k) {
      uint32_t s7 = (aux >> (7 * k)) & 127;
      uint32_t signs = s7 | ((__builtin_popcount(s7) & 1) << 7);
      for (int e = 0; e < 8; ++e) {
        uint32_t g = kGgufIq3xxsGrid[qs[8 * ib + 2 * k + (e >> 2)]];
        float v = db * grid_byte(g, e & 3);
        y[32 * ib + 8 * k + e] = (signs >> e) & 1 ? -v : v;
      }
    }
  }
}

// block_iq3_s: d, qs[64], qh[8] (9th index bits), signs[32], scales[4] (8 x 4 bits).
void decode_iq3_s(const uint8_t* b, float* y) {
  const float d = half_at(b);
  const uint8_t* qs = b + 2;
  const uint8_t* qh = b + 66;
  const uint8_t* signs = b + 74;
  const uint8_t* scales = b + 106;
  for (int ib = 0; ib < 8; ++ib) {
    int sc = (scales[ib >> 1] >> (4 * (ib & 1))) & 0xF;
    float db = d * static_cast<float>(1 + 2 * sc);
    for (int e = 0; e < 32; ++e) {
      int i = 32 * ib + e;
      int g = i >> 2;
      uint32_t idx = qs[g] | (((qh[g >> 3] >> (g & 7)) & 1) << 8);
      float v = db * grid_byte(kGgufIq3sGrid[idx], i & 3);
      y[i] = (signs[i >> 3] >> (i & 7)) & 1 ? -v : v;
    }
  }
}


// ---- AVX2 decoders of the hot types ---------------------------------------------
// Same arithmetic as the scalar decoders (one rounding per product, separate
// adds): no "fma" in the target list, so nothing can be contracted.
#if defined(__x86_64__)
#define GGUF_AVX2 __attribute__((target("avx2,f16c")))

GGUF_AVX2 inline __m256i u8x8_i32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Low / high nibbles of 16 bytes as 2 x 8 int32 each: lo[0..7], lo[8..15], hi[0..7], hi[8..15].
GGUF_AVX2 inline void nibbles16(const uint8_t* qs, __m256i out[4]) {
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  __m128i m = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(q, m), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
  out[0] = _mm256_cvtepu8_epi32(lo);
  out[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
  out[2] = _mm256_cvtepu8_epi32(hi);
  out[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

GGUF_AVX2 void decode_q4_0_avx2(const uint8_t* b, float* y) {
  __m256 d = _mm256_set1_ps(half_at(b));
  __m256i q[4];
  nibbles16(b + 2, q);
  for (int i = 0; i < 4; ++i) {
    __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], _mm256_set1_epi32(8)));
    _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, v));
  }
}

GGUF_AVX2 void decode_q4_1_avx2(const uint8_t* b, float* y) {
  __m256 d = _mm256_set1_ps(half_at(b)), m = _mm256_set1_ps(half_at(b + 2));
  __m256i q[4];
  nibbles16(b + 4, q);
  for (int i = 0; i < 4; ++i) {
    __m256 t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q[i]));
    _mm256_storeu_ps(y + 8 * i, _mm256_add_ps(t, m));
  }
}

// MXFP4: the 16 doubled E2M1 values as an int8 table, looked up 16 nibbles at a time
// (pshufb), widened to int32 and scaled as the scalar decoder does (one rounding per product).
GGUF_AVX2 void decode_mxfp4_avx2(const uint8_t* b, float* y) {
  const __m256 d = _mm256_set1_ps(gguf_e8m0_half(b[0]));
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kGgufMxfp4Values));
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1));
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, m));
  const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), m));
  const __m256i v[4] = {_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                        _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
  for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v[i])));
}

// 8 lanes of ((qh >> j0) & 1) << 4 for j = j0 .. j0 + 7.
GGUF_AVX2 inline __m256i high_bits8(uint32_t qh, int j0) {
  __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>((qh >> j0) & 0xFF)), sel);
  return _mm256_and_si256(_mm256_cmpeq_epi32(b, sel), _mm256_set1_epi32(16));
}

GGUF_AVX2 void decode_q5_0_avx2(const uint8_t* b, float* y) {
  __m256 d = _mm256_set1_ps(half_at(b));
  uint32_t qh = u32_at(b + 2);
  __m256i q[4];
  nibbles16(b + 6, q);
  for (int i = 0; i < 4; ++i) {
    __m256i v = _mm256_or_si256(q[i], high_bits8(qh, 8 * i));
    v = _mm256_sub_epi32(v, _mm256_set1_epi32(16));
    _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
  }
}

GGUF_AVX2 void decode_q8_0_avx2(const uint8_t* b, float* y) {
  __m256 d = _mm256_set1_ps(half_at(b));
  for (int i = 0; i < 4; ++i) {
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
    _mm256_storeu_ps(y + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
  }
}

GGUF_AVX2 void decode_q4_k_avx2(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(b + 4, j, &sc, &mn);
    __m256 dj = _mm256_set1_ps(d * static_cast<float>(sc));
    __m256 mj = _mm256_set1_ps(dmin * static_cast<float>(mn));
    const uint8_t* qs = b + 16 + 32 * (j >> 1);
    __m128i sh = _mm_cvtsi32_si128(4 * (j & 1));
    for (int l = 0; l < 32; l += 8) {
      __m256i q = _mm256_and_si256(_mm256_srl_epi32(u8x8_i32(qs + l), sh), _mm256_set1_epi32(0xF));
      __m256 t = _mm256_mul_ps(dj, _mm256_cvtepi32_ps(q));
      _mm256_storeu_ps(y + 32 * j + l, _mm256_sub_ps(t, mj));
    }
  }
}

GGUF_AVX2 void decode_q6_k_avx2(const uint8_t* b, float* y) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      const uint8_t* ql = b + 64 * h + 32 * (s & 1);
      const uint8_t* qh = b + 128 + 32 * h;
      __m128i shl = _mm_cvtsi32_si128(4 * (s >> 1)), shh = _mm_cvtsi32_si128(2 * s);
      for (int l = 0; l < 32; l += 8) {
        int i = 128 * h + 32 * s + l;
        __m256 ds = _mm256_set1_ps(d * static_cast<float>(sc[i >> 4]));
        __m256i lo = _mm256_and_si256(_mm256_srl_epi32(u8x8_i32(ql + l), shl), _mm256_set1_epi32(0xF));
        __m256i hi = _mm256_and_si256(_mm256_srl_epi32(u8x8_i32(qh + l), shh), _mm256_set1_epi32(3));
        __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(ds, _mm256_cvtepi32_ps(q)));
      }
    }
  }
}

GGUF_AVX2 void decode_f16_avx2(const uint8_t* src, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    y[i] = f16_to_float(h);
  }
}

GGUF_AVX2 void decode_bf16_avx2(const uint8_t* src, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i)));
    _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    y[i] = bf16_to_float(h);
  }
}

bool has_avx2_f16c() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return ok;
}
#endif  // __x86_64__

template <Elt E>
void store_row(const float* src, int64_t n, void* dst) {
  auto* o = static_cast<typename EltTraits<E>::Storage*>(dst);
  for (int64_t i = 0; i < n; ++i) EltTraits<E>::store(o + i, src[i]);
}

}  // namespace

GgufBlockDecoder gguf_block_decoder(GGMLType type) {
#if defined(__x86_64__)
  if (has_avx2_f16c()) {
    switch (type) {
      case GGMLType::kQ4_0: return decode_q4_0_avx2;
      case GGMLType::kQ4_1: return decode_q4_1_avx2;
      case GGMLType::kQ5_0: return decode_q5_0_avx2;
      case GGMLType::kQ8_0: return decode_q8_0_avx2;
      case GGMLType::kQ4_K: return decode_q4_k_avx2;
      case GGMLType::kQ6_K: return decode_q6_k_avx2;
      case GGMLType::kMXFP4: return decode_mxfp4_avx2;
      default: break;
    }
  }
#endif
  switch (type) {
    case GGMLType::kQ4_0: return decode_q4_0;
    case GGMLType::kQ4_1: return decode_q4_1;
    case GGMLType::kQ5_0: return decode_q5_0;
    case GGMLType::kQ5_1: return decode_q5_1;
    case GGMLType::kQ8_0: return decode_q8_0;
    case GGMLType::kQ2_K: return decode_q2_k;
    case GGMLType::kQ3_K: return decode_q3_k;
    case GGMLType::kQ4_K: return decode_q4_k;
    case GGMLType::kQ5_K: return decode_q5_k;
    case GGMLType::kQ6_K: return decode_q6_k;
    case GGMLType::kIQ4_NL: return decode_iq4_nl;
    case GGMLType::kMXFP4: return decode_mxfp4;
    case GGMLType::kIQ4_XS: return decode_iq4_xs;
    case GGMLType::kIQ3_XXS: return decode_iq3_xxs;
    case GGMLType::kIQ3_S: return decode_iq3_s;
    default: return nullptr;
  }
}

void gguf_decode_row(GGMLType type, const uint8_t* src, int64_t n, float* out) {
  switch (type) {
    case GGMLType::kF32:
      std::memcpy(out, src, n * sizeof(float));
      return;
    case GGMLType::kF16:
#if defined(__x86_64__)
      if (has_avx2_f16c()) return decode_f16_avx2(src, n, out);
#endif
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_to_float(h);
      }
      return;
    case GGMLType::kBF16:
#if defined(__x86_64__)
      if (has_avx2_f16c()) return decode_bf16_avx2(src, n, out);
#endif
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_float(h);
      }
      return;
    default: break;
  }
  GgufBlockDecoder dec = gguf_block_decoder(type);
  gguf::TypeInfo ti = gguf::type_info(type);
  for (int64_t i = 0; i < n / ti.block_size; ++i) {
    dec(src + i * ti.type_size, out + i * ti.block_size);
  }
}

void gguf_dequantize_rows(const GgufDequantizeRows& a) {
  const int64_t rb = gguf::row_bytes(a.type, a.cols);
  const auto* src = static_cast<const uint8_t*>(a.blocks);
  const size_t out_size = a.out_elt == Elt::kF32 ? 4 : 2;
  int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, a.cols));
  parallel_for(a.rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(a.out_elt == Elt::kF32 ? 0 : a.cols);
    for (int64_t r = begin; r < end; ++r) {
      void* dst = static_cast<uint8_t*>(a.out) + r * a.cols * out_size;
      float* y = a.out_elt == Elt::kF32 ? static_cast<float*>(dst) : tmp.data();
      gguf_decode_row(a.type, src + r * rb, a.cols, y);
      if (a.out_elt == Elt::kF16) store_row<Elt::kF16>(y, a.cols, dst);
      if (a.out_elt == Elt::kBF16) store_row<Elt::kBF16>(y, a.cols, dst);
    }
  });
}

}  // namespace vllm_metal::cpu

// ---- the integer path, scalar: chunk decoders and the reference kernels ------------------

namespace vllm_metal::cpu {

namespace {

// a / c of both halves, and the chunk's 32 integer weights.
inline void chunk_scales(GgufQ8Chunk* o, float a, float c) {
  o->a[0] = o->a[1] = a;
  o->c[0] = o->c[1] = c;
}

template <GGMLType T>
inline bool q8_chunk(const uint8_t* b, int j, GgufQ8Chunk* o) {
  int8_t* q = o->q;
  if constexpr (T == GGMLType::kQ4_0 || T == GGMLType::kQ4_1) {
    const bool has_min = T == GGMLType::kQ4_1;
    const uint8_t* qs = b + (has_min ? 4 : 2);
    for (int l = 0; l < 16; ++l) {
      int lo = qs[l] & 0xF, hi = qs[l] >> 4;
      if constexpr (T == GGMLType::kQ4_0) {
        lo -= 8;
        hi -= 8;
      }
      q[l] = static_cast<int8_t>(lo);
      q[l + 16] = static_cast<int8_t>(hi);
    }
    chunk_scales(o, half_at(b), has_min ? half_at(b + 2) : 0.0f);
  } else if constexpr (T == GGMLType::kQ5_0 || T == GGMLType::kQ5_1) {
    const bool has_min = T == GGMLType::kQ5_1;
    const uint32_t qh = u32_at(b + (has_min ? 4 : 2));
    const uint8_t* qs = b + (has_min ? 8 : 6);
    const int off = has_min ? 0 : 16;
    for (int l = 0; l < 16; ++l) {
      q[l] = static_cast<int8_t>(((qs[l] & 0xF) | (((qh >> l) & 1) << 4)) - off);
      q[l + 16] = static_cast<int8_t>(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - off);
    }
    chunk_scales(o, half_at(b), has_min ? half_at(b + 2) : 0.0f);
  } else if constexpr (T == GGMLType::kQ8_0) {
    std::memcpy(q, b + 2, 32);
    chunk_scales(o, half_at(b), 0.0f);
  } else if constexpr (T == GGMLType::kMXFP4) {
    for (int l = 0; l < 16; ++l) {
      q[l] = kGgufMxfp4Values[b[1 + l] & 0xF];
      q[l + 16] = kGgufMxfp4Values[b[1 + l] >> 4];
    }
    chunk_scales(o, gguf_e8m0_half(b[0]), 0.0f);
  } else if constexpr (T == GGMLType::kQ4_K || T == GGMLType::kQ5_K) {
    int sc, mn;
    k_scale_min(b + 4, j, &sc, &mn);
    const uint8_t* qs = b + (T == GGMLType::kQ4_K ? 16 : 48) + 32 * (j >> 1);
    for (int l = 0; l < 32; ++l) {
      int v = (qs[l] >> (4 * (j & 1))) & 0xF;
      if constexpr (T == GGMLType::kQ5_K) v |= ((b[16 + l] >> j) & 1) << 4;
      q[l] = static_cast<int8_t>(v);
    }
    chunk_scales(o, half_at(b) * static_cast<float>(sc), -(half_at(b + 2) * static_cast<float>(mn)));
  } else if constexpr (T == GGMLType::kQ6_K) {
    const int h = j >> 2, s = j & 3;
    const uint8_t* ql = b + 64 * h + 32 * (s & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      int lo = (ql[l] >> (4 * (s >> 1))) & 0xF, hi = (qh[l] >> (2 * s)) & 3;
      q[l] = static_cast<int8_t>((lo | (hi << 4)) - 32);
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int hh = 0; hh < 2; ++hh) {
      o->a[hh] = d * static_cast<float>(sc[2 * j + hh]);
      o->c[hh] = 0.0f;
    }
  } else {
    return false;
  }
  return true;
}

// y = sum over chunks of d_x * (a0 * (q . qx)[0:16] + a1 * (q . qx)[16:32] + c0 * s0 + c1 * s1).
template <GGMLType T>
void q8_dot_scalar(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                   int64_t ldy) {
  const gguf::TypeInfo ti = gguf::type_info(T);
  const int64_t nblocks = x.k / ti.block_size, nb32 = x.k / 32;
  const int chunks = static_cast<int>(ti.block_size / 32);
  GgufQ8Chunk ch;
  for (int64_t r = 0; r < rows; ++r) {
    float acc[8] = {};
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      for (int j = 0; j < chunks; ++j) {
        q8_chunk<T>(w + r * rb + blk * ti.type_size, j, &ch);
        const int64_t b = blk * chunks + j;
        for (int64_t i = 0; i < x.m; ++i) {
          const int8_t* xq = x.q + i * x.k + 32 * b;
          int32_t s0 = 0, s1 = 0;
          for (int l = 0; l < 16; ++l) s0 += ch.q[l] * xq[l];
          for (int l = 16; l < 32; ++l) s1 += ch.q[l] * xq[l];
          const int16_t* s16 = x.sum16 + i * 2 * nb32 + 2 * b;
          float t = ch.a[0] * static_cast<float>(s0) + ch.a[1] * static_cast<float>(s1) +
                    ch.c[0] * static_cast<float>(s16[0]) + ch.c[1] * static_cast<float>(s16[1]);
          acc[i] += x.d[i * nb32 + b] * t;
        }
      }
    }
    for (int64_t i = 0; i < x.m; ++i) y[i * ldy + r] = acc[i];
  }
}

void quantize_q8_scalar(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* dsum,
                        int16_t* sum16) {
  for (int64_t b = 0; b < m * k / 32; ++b) {
    const float* v = x + 32 * b;
    float amax = 0.0f;
    for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(v[l]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sums[2] = {0, 0};
    for (int l = 0; l < 32; ++l) {
      float t = v[l] * inv;
      int qi = std::isfinite(t) ? static_cast<int>(std::nearbyint(t)) : 0;
      q[32 * b + l] = static_cast<int8_t>(qi);
      sums[l >> 4] += qi;
    }
    d[b] = amax / 127.0f;
    dsum[b] = d[b] * static_cast<float>(sums[0] + sums[1]);
    sum16[2 * b] = static_cast<int16_t>(sums[0]);
    sum16[2 * b + 1] = static_cast<int16_t>(sums[1]);
  }
}

template <GGMLType T>
void float_dot_scalar(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t m,
                      int64_t k, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * rb;
    float acc[8] = {};
    for (int64_t p = 0; p < k; ++p) {
      float wv;
      if constexpr (T == GGMLType::kF32) {
        std::memcpy(&wv, src + 4 * p, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, src + 2 * p, 2);
        wv = T == GGMLType::kF16 ? f16_to_float(h) : bf16_to_float(h);
      }
      for (int64_t i = 0; i < m; ++i) acc[i] += wv * x[i * k + p];
    }
    for (int64_t i = 0; i < m; ++i) y[i * ldy + r] = acc[i];
  }
}

void panel_scalar(const float* xp, const float* w, int64_t ldw, int nr, int64_t k, float* out,
                  int64_t ldo, bool accumulate) {
  for (int j = 0; j < nr; ++j) {
    float acc[kGgufPanelWidth] = {};
    for (int64_t p = 0; p < k; ++p) {
      for (int i = 0; i < kGgufPanelWidth; ++i) acc[i] += xp[p * kGgufPanelWidth + i] * w[j * ldw + p];
    }
    for (int i = 0; i < kGgufPanelWidth; ++i) out[i * ldo + j] = accumulate ? out[i * ldo + j] + acc[i] : acc[i];
  }
}

GgufKernels make_scalar_kernels() {
  GgufKernels t;
  t.name = "scalar";
  t.quantize_q8 = quantize_q8_scalar;
#define GGUF_SCALAR_Q8(T) t.q8_dot[static_cast<int>(GGMLType::T)] = q8_dot_scalar<GGMLType::T>
  GGUF_SCALAR_Q8(kQ4_0);
  GGUF_SCALAR_Q8(kQ4_1);
  GGUF_SCALAR_Q8(kQ5_0);
  GGUF_SCALAR_Q8(kQ5_1);
  GGUF_SCALAR_Q8(kQ8_0);
  GGUF_SCALAR_Q8(kQ4_K);
  GGUF_SCALAR_Q8(kQ5_K);
  GGUF_SCALAR_Q8(kQ6_K);
  GGUF_SCALAR_Q8(kMXFP4);
#undef GGUF_SCALAR_Q8
  t.float_dot[static_cast<int>(GGMLType::kF32)] = float_dot_scalar<GGMLType::kF32>;
  t.float_dot[static_cast<int>(GGMLType::kF16)] = float_dot_scalar<GGMLType::kF16>;
  t.float_dot[static_cast<int>(GGMLType::kBF16)] = float_dot_scalar<GGMLType::kBF16>;
  t.panel = panel_scalar;
  t.panel_rows = 4;
  return t;
}

}  // namespace

bool gguf_q8_chunk(GGMLType type, const uint8_t* block, int j, GgufQ8Chunk* out) {
  switch (type) {
#define GGUF_CHUNK_CASE(T) \
  case GGMLType::T: return q8_chunk<GGMLType::T>(block, j, out);
    GGUF_CHUNK_CASE(kQ4_0)
    GGUF_CHUNK_CASE(kQ4_1)
    GGUF_CHUNK_CASE(kQ5_0)
    GGUF_CHUNK_CASE(kQ5_1)
    GGUF_CHUNK_CASE(kQ8_0)
    GGUF_CHUNK_CASE(kQ4_K)
    GGUF_CHUNK_CASE(kQ5_K)
    GGUF_CHUNK_CASE(kQ6_K)
    GGUF_CHUNK_CASE(kMXFP4)
#undef GGUF_CHUNK_CASE
    default: return false;
  }
}

const GgufKernels& gguf_kernels_scalar() {
  static const GgufKernels t = make_scalar_kernels();
  return t;
}

}  // namespace vllm_metal::cpu
