// x86-64 kernels of the GGUF matmul, written once for two instruction sets.
//
// Included only by gguf_dot_avx2.cpp and gguf_dot_avx512.cpp, after each has
// set its target with a pragma and defined GGUF_X86_VNNI (0: AVX2
// maddubs + madd, 1: AVX-512 VNNI dpbusd on 256-bit vectors) and
// GGUF_X86_AVX512 (1: 512-bit prefill panels). Everything here has internal
// linkage, so the two copies never meet. No include guard on purpose.
//
// Integer dots multiply unsigned weight bytes with signed activation bytes
// (maddubs / dpbusd take u8 x s8); weight offsets (Q4_0's -8, Q5_0's -16,
// Q6_K's -32) and mins are applied afterwards from the activations' block
// sums. maddubs adds two u8 x s8 products in int16: with |q_x| <= 127 and
// weights <= 63 it cannot saturate; Q8_0's signed weights go through
// abs / sign instead (128 * 127 * 2 < 32767).

namespace {

using gguf::GGMLType;

// ---- small helpers ---------------------------------------------------------------------

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline __m256 f16_bcast(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}
inline __m256i load256(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// 8 int32 lanes, each the sum of 4 products u8 * s8 of the 32 bytes.
inline __m256i idot(__m256i u, __m256i s) {
#if GGUF_X86_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 16 bytes of nibbles as 32 bytes: low nibbles (weights 0..15), then high (16..31). A
// broadcast load and a per-lane shift: no shuffle-port uop (an insert would take one).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i by_half = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
  return _mm256_and_si256(_mm256_srlv_epi32(v, by_half), _mm256_set1_epi8(0x0F));
}

// Lanes 0 and 1: the two f16 values at p as floats (lanes 2, 3: the next four bytes, unused).
// vcvtph2ps reading memory needs no shuffle-port uop, unlike a broadcast of one f16.
inline __m128 f16_pair(const uint8_t* p) {
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Byte l = 0x10 where bit l of qh is set (the fifth bit of Q5_0 / Q5_1 weights).
inline __m256i fifth_bits(uint32_t qh) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
  v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

// Weight rows stream through once per call, and on some server cores one core keeps too
// few misses in flight to reach the memory's bandwidth alone (2026-12-04, a Xeon VM: 1.5x on
// SmolLM2's one-row mat-vecs): each row requests the row about this far ahead.
constexpr int64_t kPrefetchAheadBytes = 6144;

inline void prefetch_row_ahead(const uint8_t* row, int64_t r, int64_t rows, int64_t rb) {
  const int64_t ahead = std::max<int64_t>(1, kPrefetchAheadBytes / rb);
  if (r + ahead < rows) prefetch_bytes(row + ahead * rb, rb);
}

// ---- legacy 32-weight blocks -----------------------------------------------------------
//
// One block: d (u . q_x) d_x plus a term from the activations' block sums. The one-row
// kernels were bound by the shuffle port on Intel cores (an f16 broadcast, a 128-bit insert
// and a scalar conversion per block: ~5 uops there against ~2 in llama.cpp's, 2026-12-04):
// now the nibbles split with a per-lane shift, d and m convert straight from memory, and one
// multiply by the activations' pair [d_x, d_x sum(q_x)] gives both factors of the block.

struct LegacyBlock {
  __m256i u;  // the 32 weights as unsigned bytes (Q4_0 / Q5_0 / Q8_0: offset by 8 / 16 / 128)
  __m128 dm;  // lane 0: d; lane 1: Q4_1 / Q5_1's m (other types: bytes that follow d, unused)
  float d() const { return _mm_cvtss_f32(dm); }
  float m() const { return _mm_cvtss_f32(_mm_movehdup_ps(dm)); }
};

// Per type: kBytes, load(), add() (the block's additive term per d_x sum(q_x)), and how the
// kernels apply it: kMin (float m, Q4_1 / Q5_1) or kOffsetShift >= 0 (integer offset
// -(1 << shift) per weight, subtracted as -(sum q_x) << shift in the integer dot).
template <GGMLType T>
struct Legacy;

template <>
struct Legacy<GGMLType::kQ4_0> {
  static constexpr int kBytes = 18, kOffsetShift = 3;
  static constexpr bool kMin = false;
  static LegacyBlock load(const uint8_t* b) { return {nibbles32(b + 2), f16_pair(b)}; }
  static float add(const LegacyBlock& wb) { return -8.0f * wb.d(); }
};
template <>
struct Legacy<GGMLType::kQ4_1> {
  static constexpr int kBytes = 20, kOffsetShift = -1;
  static constexpr bool kMin = true;
  static LegacyBlock load(const uint8_t* b) { return {nibbles32(b + 4), f16_pair(b)}; }
  static float add(const LegacyBlock& wb) { return wb.m(); }
};
template <>
struct Legacy<GGMLType::kQ5_0> {
  static constexpr int kBytes = 22, kOffsetShift = 4;
  static constexpr bool kMin = false;
  static LegacyBlock load(const uint8_t* b) {
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    return {_mm256_or_si256(nibbles32(b + 6), fifth_bits(qh)), f16_pair(b)};
  }
  static float add(const LegacyBlock& wb) { return -16.0f * wb.d(); }
};
template <>
struct Legacy<GGMLType::kQ5_1> {
  static constexpr int kBytes = 24, kOffsetShift = -1;
  static constexpr bool kMin = true;
  static LegacyBlock load(const uint8_t* b) {
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    return {_mm256_or_si256(nibbles32(b + 8), fifth_bits(qh)), f16_pair(b)};
  }
  static float add(const LegacyBlock& wb) { return wb.m(); }
};
// Q8_0's signed weights. VNNI: u = q + 128 (offset -128). AVX2: u keeps q and the dot
// takes |q| . sign(q_x, q) (maddubs' int16 pairs would overflow on q + 128).
template <>
struct Legacy<GGMLType::kQ8_0> {
  static constexpr int kBytes = 34, kOffsetShift = GGUF_X86_VNNI ? 7 : -1;
  static constexpr bool kMin = false;
  static LegacyBlock load(const uint8_t* b) {
    const __m256i q = load256(b + 2);
#if GGUF_X86_VNNI
    return {_mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))), f16_pair(b)};
#else
    return {q, f16_pair(b)};
#endif
  }
};

// MXFP4 (gpt-oss): the doubled E2M1 values (-12 .. 12) looked up from their nibbles as
// u = value + 16 (offset -16), scale 2^(e - 128) (gguf_e8m0_half).
template <>
struct Legacy<GGMLType::kMXFP4> {
  static constexpr int kBytes = 17, kOffsetShift = 4;
  static constexpr bool kMin = false;
  static LegacyBlock load(const uint8_t* b) {
    const __m128i lut = _mm_add_epi8(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(kGgufMxfp4Values)), _mm_set1_epi8(16));
    const __m256i u = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(lut), nibbles32(b + 1));
    return {u, _mm_set_ss(gguf_e8m0_half(b[0]))};
  }
  static float add(const LegacyBlock& wb) { return -16.0f * wb.d(); }
};

// u . q_x as 8 int32 lanes, plus init.
template <GGMLType T>
inline __m256i legacy_dot(const LegacyBlock& wb, __m256i xq, __m256i init) {
#if GGUF_X86_VNNI
  return _mm256_dpbusd_epi32(init, wb.u, xq);
#else
  if constexpr (T == GGMLType::kQ8_0) {
    return _mm256_add_epi32(init, idot(_mm256_sign_epi8(wb.u, wb.u), _mm256_sign_epi8(xq, wb.u)));
  } else {
    return _mm256_add_epi32(init, idot(wb.u, xq));
  }
#endif
}

// Lane 0: -(sum of the block's q_x) << shift, the other lanes 0 (a load, no shuffle).
template <int kShift>
inline __m256i offset_lane(const int32_t* neg_qsum) {
  if constexpr (kShift < 0) {
    return _mm256_setzero_si256();
  } else {
    return _mm256_slli_epi32(_mm256_zextsi128_si256(_mm_loadu_si32(neg_qsum)), kShift);
  }
}

// [d_x, d_x sum(q_x)] of activation row i's block b.
inline __m128 x_pair(const GgufQ8Rows& x, int64_t nb, int i, int64_t b) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.dpair + 2 * (i * nb + b))));
}

// block(b, chain) for b < nb, consecutive blocks on kChains accumulator chains in turn (the
// tail on chain 0).
template <int kChains, class F>
inline void for_blocks_in_chains(int64_t nb, const F& block) {
  int64_t b = 0;
  for (; b + kChains <= nb; b += kChains) {
#pragma GCC unroll 2
    for (int c = 0; c < kChains; ++c) block(b + c, c);
  }
  for (; b < nb; ++b) block(b, 0);
}

// rows(M, x rows, their y) over x [m, k] in passes of up to 4 rows, M a std::integral_constant:
// kernels whose accumulators fill the registers at 4 rows.
template <class F>
inline void in_passes_of_4(int64_t m, int64_t k, const float* x, float* y, int64_t ldy,
                           const F& rows) {
  for (int64_t i0 = 0; i0 < m; i0 += 4) {
    const float* xi = x + i0 * k;
    float* yi = y + i0 * ldy;
    switch (std::min<int64_t>(4, m - i0)) {
      case 1: rows(std::integral_constant<int, 1>{}, xi, yi); break;
      case 2: rows(std::integral_constant<int, 2>{}, xi, yi); break;
      case 3: rows(std::integral_constant<int, 3>{}, xi, yi); break;
      default: rows(std::integral_constant<int, 4>{}, xi, yi); break;
    }
  }
}

// y[i] = sum_b d_w d_x (u . q_x) + (m d_x sum(q_x) | the integer offset). Every activation
// row runs two accumulator chains, even and odd blocks (the FMA latency, not the ports, bounds
// one chain at one row), whatever M: a row's sum does not depend on the rows beside it.
template <GGMLType T, int M>
void legacy_rows(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                 int64_t ldy) {
  using B = Legacy<T>;
  constexpr int kChains = 2;
  const int64_t nb = x.k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * rb;
    prefetch_row_ahead(row, r, rows, rb);
    __m256 acc[M][kChains];
    __m128 mins[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      for (int c = 0; c < kChains; ++c) acc[i][c] = _mm256_setzero_ps();
      mins[i] = _mm_setzero_ps();
    }
    auto block = [&](int64_t b, int chain) {
      const LegacyBlock wb = B::load(row + b * B::kBytes);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const __m128 f = _mm_mul_ps(wb.dm, x_pair(x, nb, i, b));  // [d d_x, m d_x sum(q_x)]
        const __m256i s = legacy_dot<T>(wb, load256(x.q + i * x.k + 32 * b),
                                        offset_lane<B::kOffsetShift>(x.neg_qsum + i * nb + b));
        if constexpr (B::kMin) mins[i] = _mm_add_ps(mins[i], f);
        acc[i][chain] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcastss_ps(f), acc[i][chain]);
      }
    };
    for_blocks_in_chains<kChains>(nb, block);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      __m256 a = acc[i][0];
      if constexpr (kChains == 2) a = _mm256_add_ps(a, acc[i][1]);
      y[i * ldy + r] = hsum(a) + (B::kMin ? _mm_cvtss_f32(_mm_movehdup_ps(mins[i])) : 0.0f);
    }
  }
}

// ---- K quants: 256-weight super-blocks of 8 chunks ------------------------------------

// The 8 six-bit scales and mins of Q4_K / Q5_K as 8 floats each, from 12 packed bytes:
// j < 4: sc = s[j] & 63, mn = s[j + 4] & 63; j >= 4: the low 4 bits from s[j + 4]
// (scale: low nibble, min: high nibble), the top 2 bits from s[j - 4] / s[j] >> 6.
inline void k_scales(const uint8_t* s, __m256* sc, __m256* mn) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  const __m128i v = _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi),
                                   static_cast<int>(mn_lo), static_cast<int>(mn_hi));
  *sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  *mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(v, v)));
}

// Q4_K / Q5_K: y = sum_j d sc_j d_x,j (q_j . q_x,j) - dmin sum_j mn_j dsum_x,j.
template <GGMLType T, int M>
void q45_k_rows(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                int64_t ldy) {
  constexpr bool kQ5 = T == GGMLType::kQ5_K;
  constexpr int kBytes = kQ5 ? 176 : 144;
  const int64_t nsb = x.k / 256, nb = x.k / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_row_ahead(w + r * rb, r, rows, rb);
    __m256 acc[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + r * rb + sb * kBytes;
      __m256 sc, mn;
      k_scales(b + 4, &sc, &mn);
      const __m256 dsc = _mm256_mul_ps(f16_bcast(b), sc);       // [8] d * sc_j
      const __m256 mmin = _mm256_mul_ps(f16_bcast(b + 2), mn);  // [8] dmin * mn_j
      __m256i qs_lo[4], qs_hi[4];
      const uint8_t* qs = b + (kQ5 ? 48 : 16);
      for (int c = 0; c < 4; ++c) {
        __m256i v = load256(qs + 32 * c);
        qs_lo[c] = _mm256_and_si256(v, low4);
        qs_hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      if constexpr (kQ5) {
        const __m256i qh = load256(b + 16);
        const __m256i b5 = _mm256_set1_epi8(0x10);
        // bit j of qh[l] -> bit 4 of chunk j's byte l
        qs_lo[0] = _mm256_or_si256(qs_lo[0], _mm256_and_si256(_mm256_slli_epi16(qh, 4), b5));
        qs_hi[0] = _mm256_or_si256(qs_hi[0], _mm256_and_si256(_mm256_slli_epi16(qh, 3), b5));
        qs_lo[1] = _mm256_or_si256(qs_lo[1], _mm256_and_si256(_mm256_slli_epi16(qh, 2), b5));
        qs_hi[1] = _mm256_or_si256(qs_hi[1], _mm256_and_si256(_mm256_slli_epi16(qh, 1), b5));
        qs_lo[2] = _mm256_or_si256(qs_lo[2], _mm256_and_si256(qh, b5));
        qs_hi[2] = _mm256_or_si256(qs_hi[2], _mm256_and_si256(_mm256_srli_epi16(qh, 1), b5));
        qs_lo[3] = _mm256_or_si256(qs_lo[3], _mm256_and_si256(_mm256_srli_epi16(qh, 2), b5));
        qs_hi[3] = _mm256_or_si256(qs_hi[3], _mm256_and_si256(_mm256_srli_epi16(qh, 3), b5));
      }
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const int8_t* xq = x.q + i * x.k + 256 * sb;
        const __m256 dx = _mm256_loadu_ps(x.d + i * nb + 8 * sb);
        alignas(32) float f[8];
        _mm256_store_ps(f, _mm256_mul_ps(dsc, dx));
        __m256 a = _mm256_mul_ps(mmin, _mm256_loadu_ps(x.dsum + i * nb + 8 * sb));
        a = _mm256_sub_ps(acc[i], a);
        for (int c = 0; c < 4; ++c) {
          __m256i s0 = idot(qs_lo[c], load256(xq + 64 * c));
          __m256i s1 = idot(qs_hi[c], load256(xq + 64 * c + 32));
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_broadcast_ss(f + 2 * c), a);
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_broadcast_ss(f + 2 * c + 1), a);
        }
        acc[i] = a;
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) y[i * ldy + r] = hsum(acc[i]);
  }
}

// Q6_K: w = d sc_h (q - 32), 16 sub-blocks of 16. The -32 comes from the
// activations' 16-value sums: y = d sum_c d_x,c [sum_h sc_h (q . q_x)_h - 32 sum_h sc_h s16_h].
template <int M>
void q6_k_rows(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
               int64_t ldy) {
  const int64_t nsb = x.k / 256, nb = x.k / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
  for (int64_t r = 0; r < rows; ++r) {
    prefetch_row_ahead(w + r * rb, r, rows, rb);
    __m256 acc[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + r * rb + sb * 210;
      const __m256 d = f16_bcast(b + 208);
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);  // [16] int16 sub-block scales
      // chunk c's scales: sc[2c] in the low 8 int16 lanes, sc[2c + 1] in the high 8
      const __m256i sc_lo = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc16));
      const __m256i sc_hi = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(sc16, 1));
      __m256i q[8];
      for (int h = 0; h < 2; ++h) {
        const __m256i A = load256(b + 64 * h), B = load256(b + 64 * h + 32);
        const __m256i H = load256(b + 128 + 32 * h);
        q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(A, low4),
                                       _mm256_and_si256(_mm256_slli_epi16(H, 4), hi2));
        q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(B, low4),
                                       _mm256_and_si256(_mm256_slli_epi16(H, 2), hi2));
        q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low4),
                                       _mm256_and_si256(H, hi2));
        q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low4),
                                       _mm256_and_si256(_mm256_srli_epi16(H, 2), hi2));
      }
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const int8_t* xq = x.q + i * x.k + 256 * sb;
        const __m256 dx = _mm256_loadu_ps(x.d + i * nb + 8 * sb);
        // [8] per chunk: sum_h sc_h s16_h
        const __m256i s16 = load256(x.sum16 + i * 2 * nb + 16 * sb);
        __m256 offs = _mm256_cvtepi32_ps(_mm256_madd_epi16(sc16, s16));
        __m256 t = _mm256_mul_ps(_mm256_mul_ps(offs, dx), _mm256_set1_ps(-32.0f));
        alignas(32) float f[8];
        _mm256_store_ps(f, dx);
        for (int c = 0; c < 8; ++c) {
          const __m256i sel = _mm256_setr_epi8(
              4 * (c & 3), 4 * (c & 3) + 1, 4 * (c & 3), 4 * (c & 3) + 1, 4 * (c & 3), 4 * (c & 3) + 1,
              4 * (c & 3), 4 * (c & 3) + 1, 4 * (c & 3), 4 * (c & 3) + 1, 4 * (c & 3), 4 * (c & 3) + 1,
              4 * (c & 3), 4 * (c & 3) + 1, 4 * (c & 3), 4 * (c & 3) + 1, 4 * (c & 3) + 2,
              4 * (c & 3) + 3, 4 * (c & 3) + 2, 4 * (c & 3) + 3, 4 * (c & 3) + 2, 4 * (c & 3) + 3,
              4 * (c & 3) + 2, 4 * (c & 3) + 3, 4 * (c & 3) + 2, 4 * (c & 3) + 3, 4 * (c & 3) + 2,
              4 * (c & 3) + 3, 4 * (c & 3) + 2, 4 * (c & 3) + 3, 4 * (c & 3) + 2, 4 * (c & 3) + 3);
          const __m256i scv = _mm256_shuffle_epi8(c < 4 ? sc_lo : sc_hi, sel);
          __m256i p = _mm256_maddubs_epi16(q[c], load256(xq + 32 * c));
          __m256i s = _mm256_madd_epi16(p, scv);
          t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(f + c), t);
        }
        acc[i] = _mm256_fmadd_ps(t, d, acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) y[i * ldy + r] = hsum(acc[i]);
  }
}

// ---- dispatch on the number of activation rows ------------------------------------------

template <template <int> class K>
struct ByRows {
  static void run(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                  int64_t ldy) {
    switch (x.m) {
      case 1: return K<1>::run(w, rb, rows, x, y, ldy);
      case 2: return K<2>::run(w, rb, rows, x, y, ldy);
      case 3: return K<3>::run(w, rb, rows, x, y, ldy);
      case 4: return K<4>::run(w, rb, rows, x, y, ldy);
      case 5: return K<5>::run(w, rb, rows, x, y, ldy);
      case 6: return K<6>::run(w, rb, rows, x, y, ldy);
      case 7: return K<7>::run(w, rb, rows, x, y, ldy);
      default: return K<8>::run(w, rb, rows, x, y, ldy);
    }
  }
};
template <GGMLType T>
struct LegacyK {
  template <int M>
  struct K {
    static void run(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                    int64_t ldy) {
      legacy_rows<T, M>(w, rb, rows, x, y, ldy);
    }
  };
};
template <GGMLType T>
struct Q45K {
  template <int M>
  struct K {
    static void run(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                    int64_t ldy) {
      q45_k_rows<T, M>(w, rb, rows, x, y, ldy);
    }
  };
};
template <int M>
struct Q6K {
  static void run(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                  int64_t ldy) {
    q6_k_rows<M>(w, rb, rows, x, y, ldy);
  }
};

// ---- activations to 8 bits -------------------------------------------------------------

void quantize_q8_x86(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* dsum,
                     int16_t* sum16) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < m * k / 32; ++b) {
    const float* v = x + 32 * b;
    __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8);
    __m256 x2 = _mm256_loadu_ps(v + 16), x3 = _mm256_loadu_ps(v + 24);
    __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(x0, abs_mask), _mm256_and_ps(x1, abs_mask)),
                              _mm256_max_ps(_mm256_and_ps(x2, abs_mask), _mm256_and_ps(x3, abs_mask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float inv_s = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 inv = _mm256_set1_ps(inv_s);
    // round half to even (the default MXCSR mode), as the scalar reference does
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(x0, inv));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(x1, inv));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(x2, inv));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(x3, inv));
    const int s0 = hsum_i32(_mm256_add_epi32(i0, i1)), s1 = hsum_i32(_mm256_add_epi32(i2, i3));
    // packs interleave 128-bit lanes: [0..3 8..11 | 4..7 12..15] -> fix with a permute
    __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * b), p);
    d[b] = amax / 127.0f;
    dsum[b] = d[b] * static_cast<float>(s0 + s1);
    sum16[2 * b] = static_cast<int16_t>(s0);
    sum16[2 * b + 1] = static_cast<int16_t>(s1);
  }
}

// ---- float weights, float activations (m <= 8) ------------------------------------------

template <GGMLType T>
inline __m256 load_w8(const uint8_t* p) {
  if constexpr (T == GGMLType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (T == GGMLType::kF16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
}
template <GGMLType T>
inline float load_w1(const uint8_t* p) {
  if constexpr (T == GGMLType::kF32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return T == GGMLType::kF16 ? f16_to_float(h) : bf16_to_float(h);
  }
}

// Two accumulators per row hide the FMA latency when M is small.
template <GGMLType T, int M>
void float_rows(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t k, float* y,
                int64_t ldy) {
  constexpr int kEs = T == GGMLType::kF32 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * rb;
    prefetch_row_ahead(src, r, rows, rb);
    __m256 acc[M][2];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
      const __m256 w0 = load_w8<T>(src + kEs * p), w1 = load_w8<T>(src + kEs * (p + 8));
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * k + p), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * k + p + 8), acc[i][1]);
      }
    }
    for (; p + 8 <= k; p += 8) {
      const __m256 w0 = load_w8<T>(src + kEs * p);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * k + p), acc[i][0]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      float s = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
      for (int64_t q = p; q < k; ++q) s += load_w1<T>(src + kEs * q) * x[i * k + q];
      y[i * ldy + r] = s;
    }
  }
}

template <GGMLType T>
void float_dot(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t m, int64_t k,
               float* y, int64_t ldy) {
  switch (m) {
    case 1: return float_rows<T, 1>(w, rb, rows, x, k, y, ldy);
    case 2: return float_rows<T, 2>(w, rb, rows, x, k, y, ldy);
    case 3: return float_rows<T, 3>(w, rb, rows, x, k, y, ldy);
    case 4: return float_rows<T, 4>(w, rb, rows, x, k, y, ldy);
    case 5: return float_rows<T, 5>(w, rb, rows, x, k, y, ldy);
    case 6: return float_rows<T, 6>(w, rb, rows, x, k, y, ldy);
    case 7: return float_rows<T, 7>(w, rb, rows, x, k, y, ldy);
    default: return float_rows<T, 8>(w, rb, rows, x, k, y, ldy);
  }
}

// ---- exact float dots of the 32-weight block types ----------------------------------------

// The block's 32 weights as w = d * u + add (Q8_0: d * q): u as floats in four vectors,
// d broadcast, add a scalar.
template <GGMLType T>
inline void exact_units(const uint8_t* b, __m256* u, __m256* d, float* add) {
  if constexpr (T == GGMLType::kQ4_0 || T == GGMLType::kQ4_1) {
    // weights l and l + 16 are the low and high nibbles of byte l: widen 8 bytes at a time
    // straight from memory, then mask / shift (fewer shuffles than nibbles32)
    const int qs = T == GGMLType::kQ4_0 ? 2 : 4;
    *d = f16_bcast(b);
    *add = T == GGMLType::kQ4_0 ? -8.0f * _mm256_cvtss_f32(*d) : f16_at(b + 2);
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + qs)));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + qs + 8)));
    const __m256i low = _mm256_set1_epi32(0x0F);
    u[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, low));
    u[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, low));
    u[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
    u[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
  } else if constexpr (T == GGMLType::kQ8_0) {
    *d = f16_bcast(b);
    *add = 0.0f;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      u[j] = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j))));
    }
  } else {
    const LegacyBlock wb = Legacy<T>::load(b);
    *d = _mm256_set1_ps(wb.d());
    *add = Legacy<T>::add(wb);
    const __m128i lo = _mm256_castsi256_si128(wb.u);
    const __m128i hi = _mm256_extracti128_si256(wb.u, 1);
    u[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    u[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    u[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    u[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// The block's 32 weights as floats (w = d * u + add), in four vectors.
template <GGMLType T>
inline void exact_weights(const uint8_t* b, __m256* w) {
  __m256 d;
  float add;
  exact_units<T>(b, w, &d, &add);
  const __m256 a = _mm256_set1_ps(add);
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(w[j], d, a);
}


// `exact` decode rows: the weights decoded in registers and dotted with float x, the sums
// in float32 (no 8-bit activations), straight from the blocks like the integer path.
template <GGMLType T, int M>
void exact_rows(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t k, float* y,
                int64_t ldy) {
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * rb;
    prefetch_row_ahead(src, r, rows, rb);
    __m256 acc[M][2];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 wv[4];
      exact_weights<T>(src + b * Legacy<T>::kBytes, wv);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const float* xb = x + i * k + 32 * b;
        acc[i][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xb), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xb + 8), acc[i][1]);
        acc[i][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xb + 16), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xb + 24), acc[i][1]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) y[i * ldy + r] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
  }
}

// Q8_0: sum_b d_b (q_b . x_b), each block's partial sum scaled once instead of every weight
// (3 fewer vector operations a block: the lm_head of SmolLM2 2.54 -> 2.11 ms on one core),
// even and odd blocks on two chains, for every M (a row's sums do not depend on the rows
// beside it). M <= 4: two accumulators a row plus the block's units fit 16 registers.
template <int M>
void exact_rows_q8_0(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t k,
                     float* y, int64_t ldy) {
  static_assert(M <= 4, "passes of at most 4 rows");
  const int64_t nb = k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * rb;
    prefetch_row_ahead(src, r, rows, rb);
    __m256 acc[M][2];
#pragma GCC unroll 4
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    auto block = [&](int64_t b, int chain) {
      __m256 u[4], d;
      float add;
      exact_units<GGMLType::kQ8_0>(src + b * 34, u, &d, &add);
#pragma GCC unroll 4
      for (int i = 0; i < M; ++i) {
        const float* xb = x + i * k + 32 * b;
        __m256 s0 = _mm256_mul_ps(u[0], _mm256_loadu_ps(xb));
        __m256 s1 = _mm256_mul_ps(u[1], _mm256_loadu_ps(xb + 8));
        s0 = _mm256_fmadd_ps(u[2], _mm256_loadu_ps(xb + 16), s0);
        s1 = _mm256_fmadd_ps(u[3], _mm256_loadu_ps(xb + 24), s1);
        acc[i][chain] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), d, acc[i][chain]);
      }
    };
    for_blocks_in_chains<2>(nb, block);
#pragma GCC unroll 4
    for (int i = 0; i < M; ++i) y[i * ldy + r] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
  }
}

void exact_dot_q8_0(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t m,
                    int64_t k, float* y, int64_t ldy) {
  in_passes_of_4(m, k, x, y, ldy, [&](auto M, const float* xi, float* yi) {
    exact_rows_q8_0<decltype(M)::value>(w, rb, rows, xi, k, yi, ldy);
  });
}

#if GGUF_X86_AVX512
// Q4_0 / Q4_1 `exact` rows on AVX-512: each block's 16 possible weights d·u + add as a table
// of 16 floats (one FMA; the same roundings as exact_weights), and its 32 nibbles looked up
// with two vpermps, which read only the low 4 bits of each index lane: a dword lane shifted
// right by 4 j holds nibble j of its dword at the bottom, so two per-lane shifts of the
// block's 16 bytes broadcast four times give every weight's index. Lane i of the two lookups
// holds weight 4 (i % 4) + i / 4 (+ 16), so x is permuted to match once per call (one
// vpermps per 16 values). The scales of a row are converted 8 or 16 at a time a row ahead
// (copied then, converted at the next row, so the vector load does not wait on the copies).
// 1.75x the exact_weights kernel at one x row (SmolLM2's Q4_1 matrices, one core, 2026-12-04:
// 6.1 -> 10.7 GB/s).

// x rows [m, k] -> per 32-value block [X0 (16), X1 (16)] in the lookups' lane order.
inline void permute_x_for_lookup(const float* x, int64_t m, int64_t k, float* xp) {
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t o = 0; o < m * k; o += 16) {
    _mm512_storeu_ps(xp + o, _mm512_permutexvar_ps(order, _mm512_loadu_ps(x + o)));
  }
}

// A row's block scales: Q4_1 [d, m] pairs, Q4_0 d alone.
template <GGMLType T>
struct LookupScales {
  static constexpr bool kMin = T == GGMLType::kQ4_1;
  static constexpr int kWords = kMin ? 2 : 1;  // f16 values per block
  static constexpr int64_t kMaxBlocks = 512;   // k <= 16384
  alignas(64) uint16_t raw[2][kWords * kMaxBlocks];
  alignas(64) float f[kWords * kMaxBlocks];

  // Then zeros up to a whole vector of f16 values.
  void copy(const uint8_t* row, int64_t nb, int slot) {
    for (int64_t b = 0; b < nb; ++b) {
      std::memcpy(raw[slot] + kWords * b, row + b * Legacy<T>::kBytes, 2 * kWords);
    }
    for (int64_t o = kWords * nb; o % 16 != 0; ++o) raw[slot][o] = 0;
  }
  void convert(int64_t nb, int slot) {
    for (int64_t o = 0; o < kWords * nb; o += 16) {
      _mm512_store_ps(f + o, _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(raw[slot] + o))));
    }
  }
  // The block's 16 possible weights.
  __m512 table(int64_t b) const {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if constexpr (kMin) {
      return _mm512_fmadd_ps(iota, _mm512_set1_ps(f[2 * b]), _mm512_set1_ps(f[2 * b + 1]));
    } else {  // fma(u, d, -8 d) = (u - 8) d, rounded once either way
      return _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), _mm512_set1_ps(f[b]));
    }
  }
};

template <GGMLType T, int M>
void lookup_rows(const uint8_t* w, int64_t rb, int64_t rows, const float* xp, int64_t k, float* y,
                 int64_t ldy) {
  constexpr int kQs = T == GGMLType::kQ4_0 ? 2 : 4;
  constexpr int kChains = 2;  // two chains per half (FMA latency), for every M: rows independent
  const int64_t nb = k / 32;
  const __m512i sh_lo = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
  const __m512i sh_hi = _mm512_add_epi32(sh_lo, _mm512_set1_epi32(4));
  LookupScales<T> sc;
  sc.copy(w, nb, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * rb;
    prefetch_row_ahead(row, r, rows, rb);
    sc.convert(nb, r & 1);
    if (r + 1 < rows) sc.copy(row + rb, nb, (r + 1) & 1);
    __m512 acc[M][2 * kChains];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      for (int c = 0; c < 2 * kChains; ++c) acc[i][c] = _mm512_setzero_ps();
    }
    auto block = [&](int64_t b, int chain) {
      const __m512i q = _mm512_broadcast_i32x4(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * Legacy<T>::kBytes + kQs)));
      const __m512 table = sc.table(b);
      const __m512 w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(q, sh_lo), table);
      const __m512 w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(q, sh_hi), table);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const float* xb = xp + i * k + 32 * b;
        acc[i][2 * chain] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[i][2 * chain]);
        acc[i][2 * chain + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[i][2 * chain + 1]);
      }
    };
    for_blocks_in_chains<kChains>(nb, block);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      __m512 a = _mm512_add_ps(acc[i][0], acc[i][1]);
      if constexpr (kChains == 2) a = _mm512_add_ps(a, _mm512_add_ps(acc[i][2], acc[i][3]));
      y[i * ldy + r] = _mm512_reduce_add_ps(a);
    }
  }
}

template <GGMLType T>
void lookup_dot(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t m, int64_t k,
                float* y, int64_t ldy) {
  static thread_local std::vector<float> xp;
  if (static_cast<int64_t>(xp.size()) < m * k) xp.resize(m * k);
  permute_x_for_lookup(x, m, k, xp.data());
  // passes of up to 4 x rows: 4 accumulators a row fill 16 of the 32 registers
  in_passes_of_4(m, k, xp.data(), y, ldy, [&](auto M, const float* xi, float* yi) {
    lookup_rows<T, decltype(M)::value>(w, rb, rows, xi, k, yi, ldy);
  });
}
#endif

template <GGMLType T>
void exact_dot(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t m, int64_t k,
               float* y, int64_t ldy) {
#if GGUF_X86_AVX512
  if constexpr (T == GGMLType::kQ4_0 || T == GGMLType::kQ4_1) {
    if (k <= 32 * LookupScales<T>::kMaxBlocks) return lookup_dot<T>(w, rb, rows, x, m, k, y, ldy);
  }
#endif
  if constexpr (T == GGMLType::kQ8_0) return exact_dot_q8_0(w, rb, rows, x, m, k, y, ldy);
  switch (m) {
    case 1: return exact_rows<T, 1>(w, rb, rows, x, k, y, ldy);
    case 2: return exact_rows<T, 2>(w, rb, rows, x, k, y, ldy);
    case 3: return exact_rows<T, 3>(w, rb, rows, x, k, y, ldy);
    case 4: return exact_rows<T, 4>(w, rb, rows, x, k, y, ldy);
    case 5: return exact_rows<T, 5>(w, rb, rows, x, k, y, ldy);
    case 6: return exact_rows<T, 6>(w, rb, rows, x, k, y, ldy);
    case 7: return exact_rows<T, 7>(w, rb, rows, x, k, y, ldy);
    default: return exact_rows<T, 8>(w, rb, rows, x, k, y, ldy);
  }
}

// ---- prefill panels: 16 activation rows x NR weight rows ---------------------------------

#if GGUF_X86_AVX512
constexpr int kPanelRows = 12;  // 12 zmm accumulators, weights broadcast from memory
template <int NR>
void panel_nr(const float* xp, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo,
              bool accumulate) {
  __m512 acc[NR];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m512 xv = _mm512_loadu_ps(xp + p * kGgufPanelWidth);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[j * ldw + p]), xv, acc[j]);
  }
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    alignas(64) float t[16];
    _mm512_store_ps(t, acc[j]);
    for (int i = 0; i < 16; ++i) out[i * ldo + j] = accumulate ? out[i * ldo + j] + t[i] : t[i];
  }
}

// R activation rows x 32 weight columns in 2R zmm accumulators: per value of k two vector
// loads of weights and R broadcasts of x feed 2R FMAs (the panel above: 12 FMAs for 13
// loads). Runs at the FMA peak with operands in L1 / L2 (a standalone probe on Zen 4,
// 58.3 GMAC/s a core against 19-20 for panel_nr<12> in the same harness).
template <int R>
void weight_panel_r(const float* x, int64_t ldx, const float* wp, int64_t k, float* out,
                    int64_t ldo, bool accumulate, const float* bias) {
  static_assert(kGgufWeightPanelCols == 32);
  __m512 lo[R], hi[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m512 w0 = _mm512_loadu_ps(wp + p * 32);
    const __m512 w1 = _mm512_loadu_ps(wp + p * 32 + 16);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 b = _mm512_set1_ps(x[i * ldx + p]);
      lo[i] = _mm512_fmadd_ps(b, w0, lo[i]);
      hi[i] = _mm512_fmadd_ps(b, w1, hi[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    float* o = out + i * ldo;
    if (accumulate) {  // out + sum, the order of the 16-row panels' tiles
      lo[i] = _mm512_add_ps(_mm512_loadu_ps(o), lo[i]);
      hi[i] = _mm512_add_ps(_mm512_loadu_ps(o + 16), hi[i]);
    }
  }
  if (bias != nullptr) {  // after the whole sum, as a separate pass over the outputs would
    const __m512 b_lo = _mm512_loadu_ps(bias), b_hi = _mm512_loadu_ps(bias + 16);
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      lo[i] = _mm512_add_ps(lo[i], b_lo);
      hi[i] = _mm512_add_ps(hi[i], b_hi);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(out + i * ldo, lo[i]);
    _mm512_storeu_ps(out + i * ldo + 16, hi[i]);
  }
}

template <int... R>
void weight_panel_any(const float* x, int64_t ldx, int rows, const float* wp, int64_t k,
                      float* out, int64_t ldo, bool accumulate, const float* bias,
                      std::integer_sequence<int, R...>) {
  using Fn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool,
                      const float*);
  static constexpr Fn fns[] = {weight_panel_r<R + 1>...};
  fns[rows - 1](x, ldx, wp, k, out, ldo, accumulate, bias);
}

void weight_panel(const float* x, int64_t ldx, int rows, const float* wp, int64_t k, float* out,
                  int64_t ldo, bool accumulate, const float* bias) {
  weight_panel_any(x, ldx, rows, wp, k, out, ldo, accumulate, bias,
                   std::make_integer_sequence<int, kGgufWeightPanelRows>{});
}

// 16 x 16 floats in registers: r[i] holds row i on entry, column i on exit (pairs of rows
// interleaved, then pairs of pairs, then 128-bit lanes gathered in two rounds).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);
    t[4 + c] = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xdd);
    t[8 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xdd);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_f32x4(t[c], t[8 + c], 0xdd);
    r[4 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(t[4 + c], t[12 + c], 0xdd);
  }
}

// GgufPanelLayoutFn in 16 x 16 blocks: each weight row is read 64 bytes at a time and
// every store is a whole vector (the scalar transpose was a tenth of a MiniLM projection,
// most of it waiting on the weights' cache misses one float at a time).
void lay_out_panel(const float* rows, int64_t ld, int cols, int64_t k, float* panel) {
  static_assert(kGgufWeightPanelCols == 32);
  for (int j0 = 0; j0 < 32; j0 += 16) {
    const int jn = std::clamp(cols - j0, 0, 16);
    for (int64_t p0 = 0; p0 < k; p0 += 16) {
      const int pn = static_cast<int>(std::min<int64_t>(16, k - p0));
      const __mmask16 keep = static_cast<__mmask16>((1u << pn) - 1u);
      __m512 r[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        r[j] = j < jn ? _mm512_maskz_loadu_ps(keep, rows + (j0 + j) * ld + p0) : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int p = 0; p < pn; ++p) _mm512_storeu_ps(panel + (p0 + p) * 32 + j0, r[p]);
    }
  }
}
#else
constexpr int kPanelRows = 6;  // 6 x 2 ymm accumulators + 2 activation vectors + 1 broadcast
template <int NR>
void panel_nr(const float* xp, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo,
              bool accumulate) {
  __m256 acc[NR][2];
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m256 x0 = _mm256_loadu_ps(xp + p * kGgufPanelWidth);
    const __m256 x1 = _mm256_loadu_ps(xp + p * kGgufPanelWidth + 8);
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = _mm256_broadcast_ss(w + j * ldw + p);
      acc[j][0] = _mm256_fmadd_ps(wv, x0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(wv, x1, acc[j][1]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NR; ++j) {
    alignas(32) float t[16];
    _mm256_store_ps(t, acc[j][0]);
    _mm256_store_ps(t + 8, acc[j][1]);
    for (int i = 0; i < 16; ++i) out[i * ldo + j] = accumulate ? out[i * ldo + j] + t[i] : t[i];
  }
}
#endif

template <int... NR>
void panel_any(const float* xp, const float* w, int64_t ldw, int nr, int64_t k, float* out,
               int64_t ldo, bool accumulate, std::integer_sequence<int, NR...>) {
  using Fn = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, bool);
  static constexpr Fn fns[] = {panel_nr<NR + 1>...};
  fns[nr - 1](xp, w, ldw, k, out, ldo, accumulate);
}

void panel(const float* xp, const float* w, int64_t ldw, int nr, int64_t k, float* out,
           int64_t ldo, bool accumulate) {
  panel_any(xp, w, ldw, nr, k, out, ldo, accumulate, std::make_integer_sequence<int, kPanelRows>{});
}

#include "cpu/gguf_panel_x86.h"

// ---- the table ---------------------------------------------------------------------------

GgufKernels make_x86_kernels(const char* name) {
  GgufKernels t;
  t.name = name;
  t.quantize_q8 = quantize_q8_x86;
  auto set = [&](GGMLType type, GgufQ8DotFn fn) { t.q8_dot[static_cast<int>(type)] = fn; };
  set(GGMLType::kQ4_0, ByRows<LegacyK<GGMLType::kQ4_0>::K>::run);
  set(GGMLType::kQ4_1, ByRows<LegacyK<GGMLType::kQ4_1>::K>::run);
  set(GGMLType::kQ5_0, ByRows<LegacyK<GGMLType::kQ5_0>::K>::run);
  set(GGMLType::kQ5_1, ByRows<LegacyK<GGMLType::kQ5_1>::K>::run);
  set(GGMLType::kQ8_0, ByRows<LegacyK<GGMLType::kQ8_0>::K>::run);
  set(GGMLType::kQ4_K, ByRows<Q45K<GGMLType::kQ4_K>::K>::run);
  set(GGMLType::kQ5_K, ByRows<Q45K<GGMLType::kQ5_K>::K>::run);
  set(GGMLType::kQ6_K, ByRows<Q6K>::run);
  set(GGMLType::kMXFP4, ByRows<LegacyK<GGMLType::kMXFP4>::K>::run);
  t.float_dot[static_cast<int>(GGMLType::kF32)] = float_dot<GGMLType::kF32>;
  t.float_dot[static_cast<int>(GGMLType::kF16)] = float_dot<GGMLType::kF16>;
  t.float_dot[static_cast<int>(GGMLType::kBF16)] = float_dot<GGMLType::kBF16>;
  t.exact_dot[static_cast<int>(GGMLType::kQ4_0)] = exact_dot<GGMLType::kQ4_0>;
  t.exact_dot[static_cast<int>(GGMLType::kQ4_1)] = exact_dot<GGMLType::kQ4_1>;
  t.exact_dot[static_cast<int>(GGMLType::kQ5_0)] = exact_dot<GGMLType::kQ5_0>;
  t.exact_dot[static_cast<int>(GGMLType::kQ5_1)] = exact_dot<GGMLType::kQ5_1>;
  t.exact_dot[static_cast<int>(GGMLType::kQ8_0)] = exact_dot<GGMLType::kQ8_0>;
  t.exact_dot[static_cast<int>(GGMLType::kMXFP4)] = exact_dot<GGMLType::kMXFP4>;
  set_panel_kernels(t);
  t.panel = panel;
  t.panel_rows = kPanelRows;
#if GGUF_X86_AVX512
  t.weight_panel = weight_panel;
  t.lay_out_panel = lay_out_panel;
#endif
  return t;
}

}  // namespace
