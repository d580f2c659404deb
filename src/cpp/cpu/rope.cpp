#include "cpu/rope.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

template <Elt E>
using S = typename EltTraits<E>::Storage;

// Radians per unit of the 32-bit turn fraction: 2 pi / 2^32.
constexpr float kRadPerUnit = 1.4629180792671596e-09f;
// Taylor coefficients; |r| <= pi/4 after the quadrant is taken, where the
// first omitted terms are below 2e-9 (sin) and 2e-10 (cos).
constexpr float kS3 = -1.0f / 6.0f, kS5 = 1.0f / 120.0f, kS7 = -1.0f / 5040.0f,
                kS9 = 1.0f / 362880.0f;
constexpr float kC2 = -1.0f / 2.0f, kC4 = 1.0f / 24.0f, kC6 = -1.0f / 720.0f,
                kC8 = 1.0f / 40320.0f, kC10 = -1.0f / 3628800.0f;

// ---- cos/sin -----------------------------------------------------------------

// position = ph:pl and turn rate g = gh:gl, both as two 32-bit words; the top
// 32 bits of (position * g mod 2^64) are the angle as a fraction of a turn.
inline uint32_t turn_fraction(uint32_t pl, uint32_t ph, uint32_t gl, uint32_t gh) {
  return pl * gh + ph * gl + static_cast<uint32_t>((uint64_t(pl) * gl) >> 32);
}

void cos_sin_scalar(uint32_t pl, uint32_t ph, const uint32_t* lo, const uint32_t* hi,
                    int64_t begin, int64_t n, float mscale, float* c, float* s) {
  for (int64_t i = begin; i < n; ++i) {
    const uint32_t top = turn_fraction(pl, ph, lo[i], hi[i]);
    const uint32_t q = (top + (1u << 29)) >> 30;  // nearest quarter turn
    const auto rem = static_cast<int32_t>(top - (q << 30));  // [-2^29, 2^29)
    const float r = static_cast<float>(rem) * kRadPerUnit;  // [-pi/4, pi/4]
    const float r2 = r * r;
    const float sp = r + r * r2 * (kS3 + r2 * (kS5 + r2 * (kS7 + r2 * kS9)));
    const float cp = 1.0f + r2 * (kC2 + r2 * (kC4 + r2 * (kC6 + r2 * (kC8 + r2 * kC10))));
    float sv = (q & 1u) ? cp : sp;
    float cv = (q & 1u) ? sp : cp;
    if (q & 2u) sv = -sv;
    if ((q + 1u) & 2u) cv = -cv;
    c[i] = cv * mscale;
    s[i] = sv * mscale;
  }
}

// ---- rotation, scalar --------------------------------------------------------

// NeoX pairs (i, i + half) for i in [begin, half).
template <Elt E>
void neox_scalar(const S<E>* x, S<E>* y, const float* c, const float* s, int64_t begin,
                 int64_t half) {
  using T = EltTraits<E>;
  for (int64_t i = begin; i < half; ++i) {
    const float a = T::load(x + i), b = T::load(x + half + i);
    T::store(y + i, a * c[i] - b * s[i]);
    T::store(y + half + i, b * c[i] + a * s[i]);
  }
}

// GPT-J pairs (2i, 2i + 1) for i in [begin, half).
template <Elt E>
void gptj_scalar(const S<E>* x, S<E>* y, const float* c, const float* s, int64_t begin,
                 int64_t half) {
  using T = EltTraits<E>;
  for (int64_t i = begin; i < half; ++i) {
    const float a = T::load(x + 2 * i), b = T::load(x + 2 * i + 1);
    T::store(y + 2 * i, a * c[i] - b * s[i]);
    T::store(y + 2 * i + 1, b * c[i] + a * s[i]);
  }
}

// Per-token tables: c, s [half]; for GPT-J vector paths also cd [rot] (cos of
// each pair duplicated) and sd [rot] (-sin, +sin), so a pair-swapped load
// gives y = x * cd + swap(x) * sd.
struct TokenTables {
  float* c;
  float* s;
  float* cd;
  float* sd;
};

void fill_gptj_tables(const TokenTables& t, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    t.cd[2 * i] = t.cd[2 * i + 1] = t.c[i];
    t.sd[2 * i] = -t.s[i];
    t.sd[2 * i + 1] = t.s[i];
  }
}

// Any dimension stride (views of x whose last axis is not dense); tail included.
template <Elt E>
void rotate_strided(const S<E>* x, int64_t ds, S<E>* y, const float* c, const float* s,
                    int64_t half, int64_t head_size, bool neox) {
  using T = EltTraits<E>;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
    const float a = T::load(x + i1 * ds), b = T::load(x + i2 * ds);
    T::store(y + i1, a * c[i] - b * s[i]);
    T::store(y + i2, b * c[i] + a * s[i]);
  }
  for (int64_t j = 2 * half; j < head_size; ++j) y[j] = x[j * ds];
}

template <Elt E>
void rotate_scalar(const S<E>* x, S<E>* y, const TokenTables& t, int64_t half, bool neox) {
  if (neox) {
    neox_scalar<E>(x, y, t.c, t.s, 0, half);
  } else {
    gptj_scalar<E>(x, y, t.c, t.s, 0, half);
  }
}

// ---- AVX2 --------------------------------------------------------------------

#if defined(__x86_64__)
VLLM_METAL_AVX2 void cos_sin_avx2(uint32_t pl, uint32_t ph, const uint32_t* lo,
                                  const uint32_t* hi, int64_t n, float mscale, float* c,
                                  float* s) {
  const __m256i vpl = _mm256_set1_epi32(static_cast<int>(pl));
  const __m256i vph = _mm256_set1_epi32(static_cast<int>(ph));
  const __m256 vms = _mm256_set1_ps(mscale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i gl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + i));
    const __m256i gh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i));
    __m256i top = _mm256_add_epi32(_mm256_mullo_epi32(vpl, gh), _mm256_mullo_epi32(vph, gl));
    // high words of pl * gl: even lanes, then odd lanes moved down and back
    const __m256i even = _mm256_mul_epu32(vpl, gl);
    const __m256i odd = _mm256_mul_epu32(vpl, _mm256_srli_epi64(gl, 32));
    top = _mm256_add_epi32(top, _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA));
    const __m256i q = _mm256_srli_epi32(_mm256_add_epi32(top, _mm256_set1_epi32(1 << 29)), 30);
    const __m256i rem = _mm256_sub_epi32(top, _mm256_slli_epi32(q, 30));
    const __m256 r = _mm256_mul_ps(_mm256_cvtepi32_ps(rem), _mm256_set1_ps(kRadPerUnit));
    const __m256 r2 = _mm256_mul_ps(r, r);
    __m256 ps = _mm256_fmadd_ps(r2, _mm256_set1_ps(kS9), _mm256_set1_ps(kS7));
    ps = _mm256_fmadd_ps(r2, ps, _mm256_set1_ps(kS5));
    ps = _mm256_fmadd_ps(r2, ps, _mm256_set1_ps(kS3));
    const __m256 sp = _mm256_fmadd_ps(_mm256_mul_ps(r, r2), ps, r);
    __m256 pc = _mm256_fmadd_ps(r2, _mm256_set1_ps(kC10), _mm256_set1_ps(kC8));
    pc = _mm256_fmadd_ps(r2, pc, _mm256_set1_ps(kC6));
    pc = _mm256_fmadd_ps(r2, pc, _mm256_set1_ps(kC4));
    pc = _mm256_fmadd_ps(r2, pc, _mm256_set1_ps(kC2));
    const __m256 cp = _mm256_fmadd_ps(r2, pc, _mm256_set1_ps(1.0f));
    const __m256i one = _mm256_set1_epi32(1), two = _mm256_set1_epi32(2);
    const __m256 swap =
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(q, one), one));
    const __m256 ssign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(q, two), 30));
    const __m256 csign = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_and_si256(_mm256_add_epi32(q, one), two), 30));
    const __m256 sv = _mm256_xor_ps(_mm256_blendv_ps(sp, cp, swap), ssign);
    const __m256 cv = _mm256_xor_ps(_mm256_blendv_ps(cp, sp, swap), csign);
    _mm256_storeu_ps(c + i, _mm256_mul_ps(cv, vms));
    _mm256_storeu_ps(s + i, _mm256_mul_ps(sv, vms));
  }
  cos_sin_scalar(pl, ph, lo, hi, i, n, mscale, c, s);
}

template <Elt E>
VLLM_METAL_AVX2 void rotate_avx2(const S<E>* x, S<E>* y, const TokenTables& t, int64_t half,
                                 bool neox) {
  int64_t i = 0;
  if (neox) {
    for (; i + 8 <= half; i += 8) {
      const __m256 a = load8<E>(x + i), b = load8<E>(x + half + i);
      const __m256 c = _mm256_loadu_ps(t.c + i), s = _mm256_loadu_ps(t.s + i);
      store8<E>(y + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
      store8<E>(y + half + i, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
    }
    neox_scalar<E>(x, y, t.c, t.s, i, half);
  } else {
    // 8 elements = 4 pairs; element index j = 2 * pair
    for (; i + 4 <= half; i += 4) {
      const __m256 v = load8<E>(x + 2 * i);
      const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // [1, 0, 3, 2] per 128 bits
      store8<E>(y + 2 * i, _mm256_fmadd_ps(v, _mm256_loadu_ps(t.cd + 2 * i),
                                           _mm256_mul_ps(swapped, _mm256_loadu_ps(t.sd + 2 * i))));
    }
    gptj_scalar<E>(x, y, t.c, t.s, i, half);
  }
}
#endif  // __x86_64__

// ---- NEON --------------------------------------------------------------------

#if defined(__aarch64__)
void cos_sin_neon(uint32_t pl, uint32_t ph, const uint32_t* lo, const uint32_t* hi, int64_t n,
                  float mscale, float* c, float* s) {
  const uint32x4_t vpl = vdupq_n_u32(pl), vph = vdupq_n_u32(ph);
  const uint32x4_t one = vdupq_n_u32(1), two = vdupq_n_u32(2);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint32x4_t gl = vld1q_u32(lo + i), gh = vld1q_u32(hi + i);
    uint32x4_t top = vaddq_u32(vmulq_u32(vpl, gh), vmulq_u32(vph, gl));
    const uint64x2_t p0 = vmull_u32(vget_low_u32(vpl), vget_low_u32(gl));
    const uint64x2_t p1 = vmull_high_u32(vpl, gl);
    top = vaddq_u32(top, vcombine_u32(vshrn_n_u64(p0, 32), vshrn_n_u64(p1, 32)));
    const uint32x4_t q = vshrq_n_u32(vaddq_u32(top, vdupq_n_u32(1u << 29)), 30);
    const int32x4_t rem = vreinterpretq_s32_u32(vsubq_u32(top, vshlq_n_u32(q, 30)));
    const float32x4_t r = vmulq_n_f32(vcvtq_f32_s32(rem), kRadPerUnit);
    const float32x4_t r2 = vmulq_f32(r, r);
    float32x4_t ps = vfmaq_f32(vdupq_n_f32(kS7), r2, vdupq_n_f32(kS9));
    ps = vfmaq_f32(vdupq_n_f32(kS5), r2, ps);
    ps = vfmaq_f32(vdupq_n_f32(kS3), r2, ps);
    const float32x4_t sp = vfmaq_f32(r, vmulq_f32(r, r2), ps);
    float32x4_t pc = vfmaq_f32(vdupq_n_f32(kC8), r2, vdupq_n_f32(kC10));
    pc = vfmaq_f32(vdupq_n_f32(kC6), r2, pc);
    pc = vfmaq_f32(vdupq_n_f32(kC4), r2, pc);
    pc = vfmaq_f32(vdupq_n_f32(kC2), r2, pc);
    const float32x4_t cp = vfmaq_f32(vdupq_n_f32(1.0f), r2, pc);
    const uint32x4_t swap = vtstq_u32(q, one);
    const uint32x4_t ssign = vshlq_n_u32(vandq_u32(q, two), 30);
    const uint32x4_t csign = vshlq_n_u32(vandq_u32(vaddq_u32(q, one), two), 30);
    const float32x4_t sv = vreinterpretq_f32_u32(
        veorq_u32(vreinterpretq_u32_f32(vbslq_f32(swap, cp, sp)), ssign));
    const float32x4_t cv = vreinterpretq_f32_u32(
        veorq_u32(vreinterpretq_u32_f32(vbslq_f32(swap, sp, cp)), csign));
    vst1q_f32(c + i, vmulq_n_f32(cv, mscale));
    vst1q_f32(s + i, vmulq_n_f32(sv, mscale));
  }
  cos_sin_scalar(pl, ph, lo, hi, i, n, mscale, c, s);
}

template <Elt E>
void rotate_neon(const S<E>* x, S<E>* y, const TokenTables& t, int64_t half, bool neox) {
  int64_t i = 0;
  if (neox) {
    for (; i + 4 <= half; i += 4) {
      const float32x4_t a = load4<E>(x + i), b = load4<E>(x + half + i);
      const float32x4_t c = vld1q_f32(t.c + i), s = vld1q_f32(t.s + i);
      store4<E>(y + i, vfmsq_f32(vmulq_f32(a, c), b, s));
      store4<E>(y + half + i, vfmaq_f32(vmulq_f32(b, c), a, s));
    }
    neox_scalar<E>(x, y, t.c, t.s, i, half);
  } else {
    for (; i + 2 <= half; i += 2) {
      const float32x4_t v = load4<E>(x + 2 * i);
      const float32x4_t swapped = vrev64q_f32(v);  // [1, 0, 3, 2]
      store4<E>(y + 2 * i, vfmaq_f32(vmulq_f32(v, vld1q_f32(t.cd + 2 * i)), swapped,
                                     vld1q_f32(t.sd + 2 * i)));
    }
    gptj_scalar<E>(x, y, t.c, t.s, i, half);
  }
}
#endif  // __aarch64__

// ---- dispatch ----------------------------------------------------------------

using CosSinFn = void (*)(uint32_t, uint32_t, const uint32_t*, const uint32_t*, int64_t, float,
                          float*, float*);

void cos_sin_generic(uint32_t pl, uint32_t ph, const uint32_t* lo, const uint32_t* hi, int64_t n,
                     float mscale, float* c, float* s) {
  cos_sin_scalar(pl, ph, lo, hi, 0, n, mscale, c, s);
}

CosSinFn pick_cos_sin() {
#if defined(__x86_64__)
  if (has_avx2_fma()) return &cos_sin_avx2;
#elif defined(__aarch64__)
  return &cos_sin_neon;
#endif
  return &cos_sin_generic;
}

inline void split_position(int64_t position, uint32_t* pl, uint32_t* ph) {
  const auto p = static_cast<uint64_t>(position);  // two's complement: exact mod 2^64
  *pl = static_cast<uint32_t>(p);
  *ph = static_cast<uint32_t>(p >> 32);
}

template <Elt E>
void run(const RopeRows& a) {
  auto* x = static_cast<const S<E>*>(a.x);
  auto* y = static_cast<S<E>*>(a.out);
  auto rotate = &rotate_scalar<E>;
  bool vector_gptj = false;
#if defined(__x86_64__)
  if (has_avx2_fma()) {
    rotate = &rotate_avx2<E>;
    vector_gptj = true;
  }
#elif defined(__aarch64__)
  rotate = &rotate_neon<E>;
  vector_gptj = true;
#endif
  const CosSinFn cos_sin = pick_cos_sin();
  const int64_t half = a.rotary_dim / 2;
  const int64_t rot = a.rotary_dim;
  const int64_t d = a.head_size;
  const size_t tail_bytes = static_cast<size_t>(d - rot) * sizeof(S<E>);
  const bool need_gptj_tables = !a.neox && vector_gptj;
  // ~16k elements per chunk keeps thread hand-off cost well below the work.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, a.heads * d));
  parallel_for(a.tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(need_gptj_tables ? 2 * half + 2 * rot : 2 * half);
    TokenTables t{buf.data(), buf.data() + half, nullptr, nullptr};
    if (need_gptj_tables) {
      t.cd = buf.data() + 2 * half;
      t.sd = t.cd + rot;
    }
    for (int64_t tok = begin; tok < end; ++tok) {
      const int64_t position = a.positions_int64
          ? static_cast<const int64_t*>(a.positions)[tok]
          : static_cast<const int32_t*>(a.positions)[tok];
      uint32_t pl, ph;
      split_position(position, &pl, &ph);
      cos_sin(pl, ph, a.table, a.table + half, half, a.mscale, t.c, t.s);
      if (need_gptj_tables) fill_gptj_tables(t, half);
      for (int64_t h = 0; h < a.heads; ++h) {
        const S<E>* xh = x + tok * a.x_token_stride + h * a.x_head_stride;
        S<E>* yh = y + (tok * a.heads + h) * d;
        if (a.x_dim_stride != 1) {
          rotate_strided<E>(xh, a.x_dim_stride, yh, t.c, t.s, half, d, a.neox);
          continue;
        }
        rotate(xh, yh, t, half, a.neox);
        if (tail_bytes && static_cast<const void*>(xh) != static_cast<const void*>(yh)) {
          std::memcpy(yh + rot, xh + rot, tail_bytes);
        }
      }
    }
  });
}

}  // namespace

void rope_turn_table(const double* inv_freq, int64_t half, uint32_t* table) {
  // long double where it is wider (x86-64, Linux arm64): the 64-bit rate is
  // then exact to its last bit; with double, to ~2^-53 of the rate.
  constexpr long double kTwoPi = 6.283185307179586476925286766559L;
  constexpr long double kTwo64 = 18446744073709551616.0L;
  for (int64_t i = 0; i < half; ++i) {
    long double g = static_cast<long double>(inv_freq[i]) / kTwoPi;  // turns per position
    g -= std::floor(g);  // whole turns do not change the angle
    const long double units = std::nearbyint(std::ldexp(g, 64));
    const uint64_t u = units >= kTwo64 ? 0 : static_cast<uint64_t>(units);
    table[i] = static_cast<uint32_t>(u);
    table[half + i] = static_cast<uint32_t>(u >> 32);
  }
}

void rope_cos_sin(int64_t position, const uint32_t* table, int64_t half, int64_t n, float mscale,
                  float* cos_out, float* sin_out) {
  uint32_t pl, ph;
  split_position(position, &pl, &ph);
  pick_cos_sin()(pl, ph, table, table + half, n, mscale, cos_out, sin_out);
}

void rope_rows(const RopeRows& a) {
  switch (a.elt) {
    case Elt::kF32: return run<Elt::kF32>(a);
    case Elt::kF16: return run<Elt::kF16>(a);
    case Elt::kBF16: return run<Elt::kBF16>(a);
  }
}

}  // namespace vllm_metal::cpu
