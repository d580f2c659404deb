// arm64 NEON kernels of the GGUF matmul, written once for two instruction sets.
//
// Included only by gguf_matmul.cpp, twice: with GGUF_NEON_DOT 0 (plain NEON:
// vmull_s8 + vpadalq_s16) and with GGUF_NEON_DOT 1 under a "+dotprod" target
// (sdot: vdotq_s32), each inside its own namespace, so both copies live in one
// binary and the CPU picks. No include guard on purpose. (A separate source
// file would be cleaner, but the arm64 cross-build compiles a fixed file list.)
//
// Weights are decoded to signed bytes with their offsets removed (Q4_0's -8,
// Q5_0's -16, Q6_K's -32), so only the mins of Q4_1 / Q5_1 / Q4_K / Q5_K need
// the activations' block sums. Products of two int8 fit in int16.

namespace {

using gguf::GGMLType;

inline float f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

// acc + the 16 products a * b, summed in 4 lanes.
inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if GGUF_NEON_DOT
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

// Byte l of the result: 0x10 where bit (base + l) of qh is set, l < 16.
inline uint8x16_t fifth_bits16(uint32_t qh, int base) {
  static const uint8_t kBits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  const uint8x16_t v = vcombine_u8(vdup_n_u8(static_cast<uint8_t>(qh >> base)),
                                   vdup_n_u8(static_cast<uint8_t>(qh >> (base + 8))));
  return vandq_u8(vtstq_u8(v, vld1q_u8(kBits)), vdupq_n_u8(0x10));
}

// ---- legacy 32-weight blocks: q (two halves of 16 signed bytes), d, additive term ---------

struct Block32 {
  int8x16_t q0, q1;
  float d;
  float add;  // times d_x * sum(q_x): the min of Q4_1 / Q5_1, else 0
};

template <GGMLType T>
inline Block32 load_block(const uint8_t* b) {
  if constexpr (T == GGMLType::kQ4_0 || T == GGMLType::kQ4_1) {
    const bool has_min = T == GGMLType::kQ4_1;
    const uint8x16_t v = vld1q_u8(b + (has_min ? 4 : 2));
    int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
    int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    if (!has_min) {
      lo = vsubq_s8(lo, vdupq_n_s8(8));
      hi = vsubq_s8(hi, vdupq_n_s8(8));
    }
    return {lo, hi, f16_at(b), has_min ? f16_at(b + 2) : 0.0f};
  } else if constexpr (T == GGMLType::kQ5_0 || T == GGMLType::kQ5_1) {
    const bool has_min = T == GGMLType::kQ5_1;
    uint32_t qh;
    std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
    const uint8x16_t v = vld1q_u8(b + (has_min ? 8 : 6));
    int8x16_t lo = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(v, vdupq_n_u8(0x0F)), fifth_bits16(qh, 0)));
    int8x16_t hi = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(v, 4), fifth_bits16(qh, 16)));
    if (!has_min) {
      lo = vsubq_s8(lo, vdupq_n_s8(16));
      hi = vsubq_s8(hi, vdupq_n_s8(16));
    }
    return {lo, hi, f16_at(b), has_min ? f16_at(b + 2) : 0.0f};
  } else if constexpr (T == GGMLType::kMXFP4) {  // doubled E2M1 values, scale 2^(e - 128)
    const int8x16_t lut = vld1q_s8(kGgufMxfp4Values);
    const uint8x16_t v = vld1q_u8(b + 1);
    return {vqtbl1q_s8(lut, vandq_u8(v, vdupq_n_u8(0x0F))), vqtbl1q_s8(lut, vshrq_n_u8(v, 4)),
            gguf_e8m0_half(b[0]), 0.0f};
  } else {  // Q8_0
    return {vld1q_s8(reinterpret_cast<const int8_t*>(b + 2)),
            vld1q_s8(reinterpret_cast<const int8_t*>(b + 18)), f16_at(b), 0.0f};
  }
}

template <GGMLType T>
constexpr int block_bytes() {
  return T == GGMLType::kQ4_0 ? 18 : T == GGMLType::kQ4_1 ? 20 : T == GGMLType::kQ5_0 ? 22
       : T == GGMLType::kQ5_1 ? 24 : T == GGMLType::kMXFP4 ? 17 : 34;
}

template <GGMLType T, int M>
void legacy_rows(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                 int64_t ldy) {
  const int64_t nb = x.k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* blk = w + r * rb;
    float32x4_t acc[M];
    float off[M];
    for (int i = 0; i < M; ++i) {
      acc[i] = vdupq_n_f32(0.0f);
      off[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      const Block32 wb = load_block<T>(blk + b * block_bytes<T>());
      for (int i = 0; i < M; ++i) {
        const int8_t* xq = x.q + i * x.k + 32 * b;
        int32x4_t s = dot16(vdupq_n_s32(0), wb.q0, vld1q_s8(xq));
        s = dot16(s, wb.q1, vld1q_s8(xq + 16));
        acc[i] = vfmaq_n_f32(acc[i], vcvtq_f32_s32(s), wb.d * x.d[i * nb + b]);
        if constexpr (T == GGMLType::kQ4_1 || T == GGMLType::kQ5_1) off[i] += wb.add * x.dsum[i * nb + b];
      }
    }
    for (int i = 0; i < M; ++i) y[i * ldy + r] = vaddvq_f32(acc[i]) + off[i];
  }
}

// ---- K quants -------------------------------------------------------------------------------

inline void k_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// bit j of each byte of qh, moved to bit 4
template <int J>
inline uint8x16_t k_fifth(uint8x16_t qh) {
  uint8x16_t v;
  if constexpr (J < 4) {
    v = vshlq_n_u8(qh, 4 - J);
  } else if constexpr (J == 4) {
    v = qh;
  } else {
    v = vshrq_n_u8(qh, J - 4);
  }
  return vandq_u8(v, vdupq_n_u8(0x10));
}

// Q4_K / Q5_K: y = sum_j d sc_j d_x,j (q_j . q_x,j) - dmin sum_j mn_j dsum_x,j
template <GGMLType T, int J>
inline void k_chunk(const uint8_t* b, int8x16_t* q0, int8x16_t* q1) {
  constexpr bool kQ5 = T == GGMLType::kQ5_K;
  const uint8_t* qs = b + (kQ5 ? 48 : 16) + 32 * (J >> 1);
  uint8x16_t a = vld1q_u8(qs), c = vld1q_u8(qs + 16);
  if constexpr (J & 1) {
    a = vshrq_n_u8(a, 4);
    c = vshrq_n_u8(c, 4);
  } else {
    a = vandq_u8(a, vdupq_n_u8(0x0F));
    c = vandq_u8(c, vdupq_n_u8(0x0F));
  }
  if constexpr (kQ5) {
    a = vorrq_u8(a, k_fifth<J>(vld1q_u8(b + 16)));
    c = vorrq_u8(c, k_fifth<J>(vld1q_u8(b + 32)));
  }
  *q0 = vreinterpretq_s8_u8(a);
  *q1 = vreinterpretq_s8_u8(c);
}

template <GGMLType T, int M, int J = 0>
inline void k_chunks(const uint8_t* b, const GgufQ8Rows& x, int64_t sb, const float f[][8],
                     float32x4_t* acc) {
  if constexpr (J < 8) {
    int8x16_t q0, q1;
    k_chunk<T, J>(b, &q0, &q1);
    for (int i = 0; i < M; ++i) {
      const int8_t* xq = x.q + i * x.k + 256 * sb + 32 * J;
      int32x4_t s = dot16(vdupq_n_s32(0), q0, vld1q_s8(xq));
      s = dot16(s, q1, vld1q_s8(xq + 16));
      acc[i] = vfmaq_n_f32(acc[i], vcvtq_f32_s32(s), f[i][J]);
    }
    k_chunks<T, M, J + 1>(b, x, sb, f, acc);
  }
}

template <GGMLType T, int M>
void q45_k_rows(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
                int64_t ldy) {
  constexpr int kBytes = T == GGMLType::kQ5_K ? 176 : 144;
  const int64_t nsb = x.k / 256, nb = x.k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    float32x4_t acc[M];
    float off[M];
    for (int i = 0; i < M; ++i) {
      acc[i] = vdupq_n_f32(0.0f);
      off[i] = 0.0f;
    }
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + r * rb + sb * kBytes;
      uint8_t sc[8], mn[8];
      k_scales(b + 4, sc, mn);
      const float d = f16_at(b), dmin = f16_at(b + 2);
      float f[M][8];
      for (int i = 0; i < M; ++i) {
        const float* dx = x.d + i * nb + 8 * sb;
        const float* ds = x.dsum + i * nb + 8 * sb;
        float o = 0.0f;
        for (int j = 0; j < 8; ++j) {
          f[i][j] = d * static_cast<float>(sc[j]) * dx[j];
          o += static_cast<float>(mn[j]) * ds[j];
        }
        off[i] -= dmin * o;
      }
      k_chunks<T, M>(b, x, sb, f, acc);
    }
    for (int i = 0; i < M; ++i) y[i * ldy + r] = vaddvq_f32(acc[i]) + off[i];
  }
}

// Q6_K: w = d sc_h (q - 32), 16 sub-blocks of 16; q - 32 is a signed byte.
template <int S>
inline int8x16_t q6_half(const uint8_t* ql, const uint8_t* qh) {
  uint8x16_t lo = vld1q_u8(ql), h = vld1q_u8(qh);
  lo = S < 2 ? vandq_u8(lo, vdupq_n_u8(0x0F)) : vshrq_n_u8(lo, 4);
  uint8x16_t hi;
  if constexpr (S == 0) {
    hi = vshlq_n_u8(h, 4);
  } else if constexpr (S == 1) {
    hi = vshlq_n_u8(h, 2);
  } else if constexpr (S == 2) {
    hi = h;
  } else {
    hi = vshrq_n_u8(h, 2);
  }
  hi = vandq_u8(hi, vdupq_n_u8(0x30));
  return vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, hi)), vdupq_n_s8(32));
}

template <int M, int C = 0>
inline void q6_chunks(const uint8_t* b, const GgufQ8Rows& x, int64_t sb, const float* dd,
                      float32x4_t* acc) {
  if constexpr (C < 8) {
    constexpr int h = C >> 2, s = C & 3;
    const uint8_t* ql = b + 64 * h + 32 * (s & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const int8x16_t q0 = q6_half<s>(ql, qh), q1 = q6_half<s>(ql + 16, qh + 16);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const int32_t sc0 = sc[2 * C], sc1 = sc[2 * C + 1];
    for (int i = 0; i < M; ++i) {
      const int8_t* xq = x.q + i * x.k + 256 * sb + 32 * C;
      int32x4_t s0 = dot16(vdupq_n_s32(0), q0, vld1q_s8(xq));
      int32x4_t s1 = dot16(vdupq_n_s32(0), q1, vld1q_s8(xq + 16));
      int32x4_t s = vmlaq_n_s32(vmulq_n_s32(s0, sc0), s1, sc1);
      acc[i] = vfmaq_n_f32(acc[i], vcvtq_f32_s32(s), dd[i * 8 + C]);
    }
    q6_chunks<M, C + 1>(b, x, sb, dd, acc);
  }
}

template <int M>
void q6_k_rows(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,
               int64_t ldy) {
  const int64_t nsb = x.k / 256, nb = x.k / 32;
  for (int64_t r = 0; r < rows; ++r) {
    float32x4_t acc[M];
    for (int i = 0; i < M; ++i) acc[i] = vdupq_n_f32(0.0f);
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* b = w + r * rb + sb * 210;
      const float d = f16_at(b + 208);
      float dd[M * 8];  // d * d_x per chunk
      for (int i = 0; i < M; ++i) {
        for (int c = 0; c < 8; ++c) dd[i * 8 + c] = d * x.d[i * nb + 8 * sb + c];
      }
      q6_chunks<M>(b, x, sb, dd, acc);
    }
    for (int i = 0; i < M; ++i) y[i * ldy + r] = vaddvq_f32(acc[i]);
  }
}

// ---- dispatch on the number of activation rows -----------------------------------------------

#define GGUF_NEON_BY_ROWS(NAME, CALL)                                                         \
  void NAME(const uint8_t* w, int64_t rb, int64_t rows, const GgufQ8Rows& x, float* y,       \
            int64_t ldy) {                                                                    \
    switch (x.m) {                                                                            \
      case 1: return CALL<1>(w, rb, rows, x, y, ldy);                                         \
      case 2: return CALL<2>(w, rb, rows, x, y, ldy);                                         \
      case 3: return CALL<3>(w, rb, rows, x, y, ldy);                                         \
      case 4: return CALL<4>(w, rb, rows, x, y, ldy);                                         \
      case 5: return CALL<5>(w, rb, rows, x, y, ldy);                                         \
      case 6: return CALL<6>(w, rb, rows, x, y, ldy);                                         \
      case 7: return CALL<7>(w, rb, rows, x, y, ldy);                                         \
      default: return CALL<8>(w, rb, rows, x, y, ldy);                                        \
    }                                                                                         \
  }
template <int M> void q4_0_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { legacy_rows<GGMLType::kQ4_0, M>(w, rb, n, x, y, l); }
template <int M> void q4_1_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { legacy_rows<GGMLType::kQ4_1, M>(w, rb, n, x, y, l); }
template <int M> void q5_0_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { legacy_rows<GGMLType::kQ5_0, M>(w, rb, n, x, y, l); }
template <int M> void q5_1_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { legacy_rows<GGMLType::kQ5_1, M>(w, rb, n, x, y, l); }
template <int M> void q8_0_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { legacy_rows<GGMLType::kQ8_0, M>(w, rb, n, x, y, l); }
template <int M> void mxfp4_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { legacy_rows<GGMLType::kMXFP4, M>(w, rb, n, x, y, l); }
template <int M> void q4_k_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { q45_k_rows<GGMLType::kQ4_K, M>(w, rb, n, x, y, l); }
template <int M> void q5_k_m(const uint8_t* w, int64_t rb, int64_t n, const GgufQ8Rows& x, float* y, int64_t l) { q45_k_rows<GGMLType::kQ5_K, M>(w, rb, n, x, y, l); }
GGUF_NEON_BY_ROWS(q4_0_dot, q4_0_m)
GGUF_NEON_BY_ROWS(q4_1_dot, q4_1_m)
GGUF_NEON_BY_ROWS(q5_0_dot, q5_0_m)
GGUF_NEON_BY_ROWS(q5_1_dot, q5_1_m)
GGUF_NEON_BY_ROWS(q8_0_dot, q8_0_m)
GGUF_NEON_BY_ROWS(mxfp4_dot, mxfp4_m)
GGUF_NEON_BY_ROWS(q4_k_dot, q4_k_m)
GGUF_NEON_BY_ROWS(q5_k_dot, q5_k_m)
GGUF_NEON_BY_ROWS(q6_k_dot, q6_k_rows)
#undef GGUF_NEON_BY_ROWS

// ---- activations to 8 bits -------------------------------------------------------------------

void quantize_q8_neon(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* dsum,
                      int16_t* sum16) {
  for (int64_t b = 0; b < m * k / 32; ++b) {
    const float* v = x + 32 * b;
    float32x4_t xv[8];
    float32x4_t mx = vdupq_n_f32(0.0f);
    for (int j = 0; j < 8; ++j) {
      xv[j] = vld1q_f32(v + 4 * j);
      mx = vmaxq_f32(mx, vabsq_f32(xv[j]));
    }
    const float amax = vmaxvq_f32(mx);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32x4_t iv[8];
    for (int j = 0; j < 8; ++j) iv[j] = vcvtnq_s32_f32(vmulq_n_f32(xv[j], inv));  // ties to even
    const int32_t s0 = vaddvq_s32(vaddq_s32(vaddq_s32(iv[0], iv[1]), vaddq_s32(iv[2], iv[3])));
    const int32_t s1 = vaddvq_s32(vaddq_s32(vaddq_s32(iv[4], iv[5]), vaddq_s32(iv[6], iv[7])));
    for (int h = 0; h < 2; ++h) {
      int16x8_t a = vcombine_s16(vqmovn_s32(iv[4 * h]), vqmovn_s32(iv[4 * h + 1]));
      int16x8_t c = vcombine_s16(vqmovn_s32(iv[4 * h + 2]), vqmovn_s32(iv[4 * h + 3]));
      vst1q_s8(q + 32 * b + 16 * h, vcombine_s8(vqmovn_s16(a), vqmovn_s16(c)));
    }
    d[b] = amax / 127.0f;
    dsum[b] = d[b] * static_cast<float>(s0 + s1);
    sum16[2 * b] = static_cast<int16_t>(s0);
    sum16[2 * b + 1] = static_cast<int16_t>(s1);
  }
}

// ---- float weights, float activations (m <= 8) ----------------------------------------------

template <GGMLType T>
inline float32x4_t load_w4(const uint8_t* p) {
  if constexpr (T == GGMLType::kF32) {
    return vld1q_f32(reinterpret_cast<const float*>(p));
  } else if constexpr (T == GGMLType::kF16) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  } else {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
}

template <GGMLType T, int M>
void float_rows(const uint8_t* w, int64_t rb, int64_t rows, const float* x, int64_t k, float* y,
                int64_t ldy) {
  constexpr int kEs = T == GGMLType::kF32 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = w + r * rb;
    float32x4_t acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = vdupq_n_f32(0.0f);
    int64_t p = 0;
    for (; p + 8 <= k; p += 8) {
      const float32x4_t w0 = load_w4<T>(src + kEs * p), w1 = load_w4<T>(src + kEs * (p + 4));
      for (int i = 0; i < M; ++i) {
        acc[i][0] = vfmaq_f32(acc[i][0], w0, vld1q_f32(x + i * k + p));
        acc[i][1] = vfmaq_f32(acc[i][1], w1, vld1q_f32(x + i * k + p + 4));
      }
    }
    for (int i = 0; i < M; ++i) {
      float s = vaddvq_f32(vaddq_f32(acc[i][0], acc[i][1]));
      for (int64_t q = p; q < k; ++q) {
        float wv;
        if constexpr (T == GGMLType::kF32) {
          std::memcpy(&wv, src + 4 * q, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, src + 2 * q, 2);
          wv = T == GGMLType::kF16 ? f16_to_float(h) : bf16_to_float(h);
        }
        s += wv * x[i * k + q];
      }
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

// ---- prefill panels: 16 activation rows x up to 6 weight rows --------------------------------

constexpr int kPanelRows = 6;  // 6 x 4 accumulators + 4 activation vectors + 1 broadcast

template <int NR>
void panel_nr(const float* xp, const float* w, int64_t ldw, int64_t k, float* out, int64_t ldo,
              bool accumulate) {
  float32x4_t acc[NR][4];
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[j][v] = vdupq_n_f32(0.0f);
  for (int64_t p = 0; p < k; ++p) {
    float32x4_t xv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) xv[v] = vld1q_f32(xp + p * kGgufPanelWidth + 4 * v);
#pragma GCC unroll 8
    for (int j = 0; j < NR; ++j) {
      const float32x4_t wv = vld1q_dup_f32(w + j * ldw + p);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[j][v] = vfmaq_f32(acc[j][v], wv, xv[v]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NR; ++j) {
    float t[16];
    for (int v = 0; v < 4; ++v) vst1q_f32(t + 4 * v, acc[j][v]);
    for (int i = 0; i < 16; ++i) out[i * ldo + j] = accumulate ? out[i * ldo + j] + t[i] : t[i];
  }
}

void panel(const float* xp, const float* w, int64_t ldw, int nr, int64_t k, float* out,
           int64_t ldo, bool accumulate) {
  switch (nr) {
    case 1: return panel_nr<1>(xp, w, ldw, k, out, ldo, accumulate);
    case 2: return panel_nr<2>(xp, w, ldw, k, out, ldo, accumulate);
    case 3: return panel_nr<3>(xp, w, ldw, k, out, ldo, accumulate);
    case 4: return panel_nr<4>(xp, w, ldw, k, out, ldo, accumulate);
    case 5: return panel_nr<5>(xp, w, ldw, k, out, ldo, accumulate);
    default: return panel_nr<6>(xp, w, ldw, k, out, ldo, accumulate);
  }
}

GgufKernels make_neon_kernels(const char* name) {
  GgufKernels t;
  t.name = name;
  t.quantize_q8 = quantize_q8_neon;
  t.q8_dot[static_cast<int>(GGMLType::kQ4_0)] = q4_0_dot;
  t.q8_dot[static_cast<int>(GGMLType::kQ4_1)] = q4_1_dot;
  t.q8_dot[static_cast<int>(GGMLType::kQ5_0)] = q5_0_dot;
  t.q8_dot[static_cast<int>(GGMLType::kQ5_1)] = q5_1_dot;
  t.q8_dot[static_cast<int>(GGMLType::kQ8_0)] = q8_0_dot;
  t.q8_dot[static_cast<int>(GGMLType::kQ4_K)] = q4_k_dot;
  t.q8_dot[static_cast<int>(GGMLType::kQ5_K)] = q5_k_dot;
  t.q8_dot[static_cast<int>(GGMLType::kQ6_K)] = q6_k_dot;
  t.q8_dot[static_cast<int>(GGMLType::kMXFP4)] = mxfp4_dot;
  t.float_dot[static_cast<int>(GGMLType::kF32)] = float_dot<GGMLType::kF32>;
  t.float_dot[static_cast<int>(GGMLType::kF16)] = float_dot<GGMLType::kF16>;
  t.float_dot[static_cast<int>(GGMLType::kBF16)] = float_dot<GGMLType::kBF16>;
  t.panel = panel;
  t.panel_rows = kPanelRows;
  return t;
}

}  // namespace
