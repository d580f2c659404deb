// x86-64 kernels of the batched integer path (GgufQ8Panel, gguf_kernels.h): weight
// panels and their dot with many 8-bit activation rows.
//
// Included by gguf_dot_x86.h (so twice, AVX2 and AVX-512 VNNI), after its helpers.
// No include guard on purpose.
//
// Why panels: the mat-vec kernels scale every (weight block, activation row) pair in
// float and sum lanes per pair; at 16+ rows that float work, not the integer dots,
// bounds them (~30 GMAC/s a core). Here eight weight rows sit in the eight int32 lanes,
// so the float work is one scale and one offset per 256 products.

// ---- one block of one row as unsigned bytes: w = a_h * u + c_h -------------------------

// Chunks (32 weights) per block and block bytes of the panel types.
template <GGMLType T>
struct PanelBlock;
template <> struct PanelBlock<GGMLType::kQ4_0> { static constexpr int kChunks = 1, kBytes = 18; };
template <> struct PanelBlock<GGMLType::kQ4_1> { static constexpr int kChunks = 1, kBytes = 20; };
template <> struct PanelBlock<GGMLType::kQ5_0> { static constexpr int kChunks = 1, kBytes = 22; };
template <> struct PanelBlock<GGMLType::kQ5_1> { static constexpr int kChunks = 1, kBytes = 24; };
template <> struct PanelBlock<GGMLType::kQ8_0> { static constexpr int kChunks = 1, kBytes = 34; };
template <> struct PanelBlock<GGMLType::kQ4_K> { static constexpr int kChunks = 8, kBytes = 144; };
template <> struct PanelBlock<GGMLType::kQ5_K> { static constexpr int kChunks = 8, kBytes = 176; };
template <> struct PanelBlock<GGMLType::kQ6_K> { static constexpr int kChunks = 8, kBytes = 210; };

// Writes the block's chunks as 32 bytes each to u, and per chunk and half a[2 j + h],
// c[2 j + h]. kSigned (Q8_0 only): u keeps the signed weights, c = 0.
template <GGMLType T, bool kSigned>
inline void panel_block(const uint8_t* b, __m256i* u, float* a, float* c) {
  if constexpr (T == GGMLType::kQ8_0) {
    const float d = f16_at(b);
    const __m256i q = load256(b + 2);
    u[0] = kSigned ? q : _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
    a[0] = a[1] = d;
    c[0] = c[1] = kSigned ? 0.0f : -128.0f * d;
  } else if constexpr (PanelBlock<T>::kChunks == 1) {
    const LegacyBlock wb = Legacy<T>::load(b);
    u[0] = wb.u;
    a[0] = a[1] = wb.d();
    c[0] = c[1] = Legacy<T>::add(wb);
  } else if constexpr (T == GGMLType::kQ4_K || T == GGMLType::kQ5_K) {
    constexpr bool kQ5 = T == GGMLType::kQ5_K;
    __m256 sc, mn;
    k_scales(b + 4, &sc, &mn);
    alignas(32) float dsc[8], mmin[8];
    _mm256_store_ps(dsc, _mm256_mul_ps(f16_bcast(b), sc));
    _mm256_store_ps(mmin, _mm256_mul_ps(f16_bcast(b + 2), mn));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t* qs = b + (kQ5 ? 48 : 16);
    for (int g = 0; g < 4; ++g) {
      const __m256i v = load256(qs + 32 * g);
      u[2 * g] = _mm256_and_si256(v, low4);
      u[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if constexpr (kQ5) {
      // bit j of qh[l] is the fifth bit of chunk j's weight l
      const __m256i qh = load256(b + 16);
      const __m256i b5 = _mm256_set1_epi8(0x10);
      for (int j = 0; j < 8; ++j) {
        const __m256i bit = j <= 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - j))
                                   : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j - 4));
        u[j] = _mm256_or_si256(u[j], _mm256_and_si256(bit, b5));
      }
    }
    for (int j = 0; j < 8; ++j) {
      a[2 * j] = a[2 * j + 1] = dsc[j];
      c[2 * j] = c[2 * j + 1] = -mmin[j];
    }
  } else {  // Q6_K: w = d sc_h (q - 32), 16 sub-blocks of 16
    const float d = f16_at(b + 208);
    const __m256i low4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m256i A = load256(b + 64 * h), B = load256(b + 64 * h + 32);
      const __m256i H = load256(b + 128 + 32 * h);
      u[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(A, low4),
                                     _mm256_and_si256(_mm256_slli_epi16(H, 4), hi2));
      u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(B, low4),
                                     _mm256_and_si256(_mm256_slli_epi16(H, 2), hi2));
      u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), low4),
                                     _mm256_and_si256(H, hi2));
      u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), low4),
                                     _mm256_and_si256(_mm256_srli_epi16(H, 2), hi2));
    }
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int s = 0; s < 16; ++s) {  // chunk s / 2, half s % 2
      a[s] = d * static_cast<float>(sc[s]);
      c[s] = -32.0f * a[s];
    }
  }
}

// 8 x 8 transpose of 32-bit words: out[p * step] word r = in[r] word p.
inline void transpose8x32(const __m256i* in, __m256i* out, int64_t step) {
  __m256i t[8], v[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    v[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    v[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    v[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    v[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int p = 0; p < 4; ++p) {
    _mm256_store_si256(out + p * step, _mm256_permute2x128_si256(v[p], v[4 + p], 0x20));
    _mm256_store_si256(out + (p + 4) * step, _mm256_permute2x128_si256(v[p], v[4 + p], 0x31));
  }
}

constexpr int kGroupRows = 8;  // weight rows per group: a 256-bit vector of 4-byte groups

// Where the packers put one group of eight weight rows: a whole 8-row panel, or one half
// of a 16-row panel, whose vectors hold the two groups' 32 bytes side by side.
struct PanelGroup {
  __m256i* u;  // vector p of chunk j at u[(8 j + p) * step]
  float* a;    // scale s (chunk j, half h: s = j * halves + h) of row r at a[s * cols + r]
  float* c;
  int64_t step;
  int cols;
};
inline PanelGroup panel_group(GgufQ8Panel& p, int g) {
  return {reinterpret_cast<__m256i*>(p.u) + g, p.a + kGroupRows * g, p.c + kGroupRows * g,
          p.cols / kGroupRows, p.cols};
}

// Rows r0 .. r0 + NR of the panel from block `blk` of each row (NR = 8, or 1 for the
// last rows of a short panel); the decoded chunks are transposed in registers.
template <GGMLType T, bool kSigned>
void pack_block(const uint8_t* w, int64_t rb, int rows, int64_t blk, int halves,
                const PanelGroup& p) {
  constexpr int kC = PanelBlock<T>::kChunks;
  __m256i u[kGroupRows][kC];
  float a[2 * kC], c[2 * kC];
#pragma GCC unroll 8
  for (int r = 0; r < kGroupRows; ++r) {
    if (r < rows) {
      panel_block<T, kSigned>(w + r * rb + blk * PanelBlock<T>::kBytes, u[r], a, c);
    } else {  // missing rows: zero weights
      for (int j = 0; j < kC; ++j) u[r][j] = _mm256_setzero_si256();
      for (int s = 0; s < 2 * kC; ++s) a[s] = c[s] = 0.0f;
    }
    for (int j = 0; j < kC; ++j) {
      for (int h = 0; h < halves; ++h) {
        const int64_t at = ((blk * kC + j) * halves + h) * p.cols + r;
        p.a[at] = a[2 * j + h];
        p.c[at] = c[2 * j + h];
      }
    }
  }
  for (int j = 0; j < kC; ++j) {
    __m256i in[kGroupRows];
#pragma GCC unroll 8
    for (int r = 0; r < kGroupRows; ++r) in[r] = u[r][j];
    transpose8x32(in, p.u + (blk * kC + j) * 8 * p.step, p.step);
  }
}

// ---- full panels of the one-chunk types, straight from eight rows ------------------------
//
// pack_block decodes row by row and then transposes; for Q4_0 / Q4_1 / Q8_0 the scales of
// all eight rows are gathered at once and the 4-byte groups land in their lanes directly:
// a Q4 row's 16 nibble bytes hold weights 4g .. 4g + 3 (low nibbles of dword g) and
// 16 + 4g .. (its high nibbles), so a 4 x 4 dword transpose per 128-bit lane of rows
// (r, r + 4) puts dword g of row r in lane r.

// The f16 at byte 0 of each of eight rows' blocks (rows rb bytes apart) as lo, the one at
// byte 2 as hi.
inline void gather_f16_pairs(const uint8_t* b, int64_t rb, __m256* lo, __m256* hi) {
  const __m256i offs = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(static_cast<int>(rb)));
  const __m256i g = _mm256_i32gather_epi32(reinterpret_cast<const int*>(b), offs, 1);
  auto halves16 = [](__m256i v) {  // the low 16 bits of each dword, in order
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  };
  *lo = _mm256_cvtph_ps(halves16(_mm256_and_si256(g, _mm256_set1_epi32(0xFFFF))));
  *hi = _mm256_cvtph_ps(halves16(_mm256_srli_epi32(g, 16)));
}

template <GGMLType T>
void pack_block_q4x8(const uint8_t* w, int64_t rb, int64_t blk, const PanelGroup& p) {
  constexpr int kQs = T == GGMLType::kQ4_0 ? 2 : 4;
  const uint8_t* b = w + blk * PanelBlock<T>::kBytes;
  __m256i y[4];
  for (int r = 0; r < 4; ++r) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + r * rb + kQs));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (r + 4) * rb + kQs));
    y[r] = _mm256_set_m128i(hi, lo);
  }
  const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
  const __m256i z[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                        _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i* u = p.u + blk * 8 * p.step;
  for (int g = 0; g < 4; ++g) {
    _mm256_store_si256(u + g * p.step, _mm256_and_si256(z[g], low4));
    _mm256_store_si256(u + (g + 4) * p.step, _mm256_and_si256(_mm256_srli_epi16(z[g], 4), low4));
  }
  __m256 d, m;
  gather_f16_pairs(b, rb, &d, &m);
  _mm256_storeu_ps(p.a + blk * p.cols, d);
  _mm256_storeu_ps(p.c + blk * p.cols,
                   T == GGMLType::kQ4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)) : m);
}

template <bool kSigned>
void pack_block_q8x8(const uint8_t* w, int64_t rb, int64_t blk, const PanelGroup& p) {
  const uint8_t* b = w + blk * PanelBlock<GGMLType::kQ8_0>::kBytes;
  __m256i in[kGroupRows];
  for (int r = 0; r < kGroupRows; ++r) {
    const __m256i q = load256(b + r * rb + 2);
    in[r] = kSigned ? q : _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));
  }
  transpose8x32(in, p.u + blk * 8 * p.step, p.step);
  __m256 d, unused;
  gather_f16_pairs(b, rb, &d, &unused);
  _mm256_storeu_ps(p.a + blk * p.cols, d);
  _mm256_storeu_ps(p.c + blk * p.cols,
                   kSigned ? _mm256_setzero_ps() : _mm256_mul_ps(d, _mm256_set1_ps(-128.0f)));
}

// Eight rows of a panel group: the fast packers when all eight are there.
template <GGMLType T, bool kSigned>
void pack_group(const uint8_t* w, int64_t rb, int rows, int64_t blocks, int halves,
                const PanelGroup& g) {
  if (rows < kGroupRows) {
    for (int64_t blk = 0; blk < blocks; ++blk) pack_block<T, kSigned>(w, rb, rows, blk, halves, g);
    return;
  }
  // The rows after these eight come next: fetch them a block's share at a time while these
  // are decoded (the weights come from DRAM, read once per step). Past the last panel these
  // are addresses beyond the matrix: prefetches do not fault.
  const uint8_t* next = w + kGroupRows * rb;
  constexpr int kShare = kGroupRows * PanelBlock<T>::kBytes;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    prefetch_bytes(next + blk * kShare, kShare);
    if constexpr (T == GGMLType::kQ4_0 || T == GGMLType::kQ4_1) {
      pack_block_q4x8<T>(w, rb, blk, g);
    } else if constexpr (T == GGMLType::kQ8_0) {
      pack_block_q8x8<kSigned>(w, rb, blk, g);
    } else {
      pack_block<T, kSigned>(w, rb, kGroupRows, blk, halves, g);
    }
  }
}

template <GGMLType T, bool kSigned>
void pack_panel(const uint8_t* w, int64_t rb, int rows, int64_t k, GgufQ8Panel& p) {
  const int64_t blocks = k / (32 * PanelBlock<T>::kChunks);
  p.chunks = k / 32;
  p.halves = gguf_q8_panel_halves(T);
  p.signed_u = kSigned;
  for (int g = 0; g < p.cols / kGroupRows; ++g) {
    const int group_rows = std::clamp(rows - kGroupRows * g, 0, kGroupRows);
    pack_group<T, kSigned>(w + kGroupRows * g * rb, rb, group_rows, blocks, p.halves,
                           panel_group(p, g));
  }
}

// ---- the dot: R activation rows x 8 weight rows ----------------------------------------

// acc + the 4-byte groups of u (unsigned) times the broadcast 4 bytes of x (signed).
inline __m256i idot_acc(__m256i acc, __m256i u, const int8_t* x4) {
  int32_t v;
  std::memcpy(&v, x4, 4);
  const __m256i xb = _mm256_set1_epi32(v);
#if GGUF_X86_VNNI
  return _mm256_dpbusd_epi32(acc, u, xb);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xb), _mm256_set1_epi16(1)));
#endif
}
// The same for signed u: |u| times x carrying u's sign.
inline __m256i idot_acc_signed(__m256i acc, __m256i u_abs, __m256i u, const int8_t* x4) {
  int32_t v;
  std::memcpy(&v, x4, 4);
  const __m256i xb = _mm256_sign_epi8(_mm256_set1_epi32(v), u);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u_abs, xb), _mm256_set1_epi16(1)));
}

// A tile kernel: activation rows i0 .. i0 + R of x against the whole panel.
using PanelTileFn = void (*)(const GgufQ8Panel&, const GgufQ8Rows&, int64_t, float*, int64_t);

// Every row of x in tiles of the widest kernel (tile[N - 1]), the rest by the one of its size.
template <size_t N>
void run_row_tiles(const PanelTileFn (&tile)[N], const GgufQ8Panel& p, const GgufQ8Rows& x,
                   float* y, int64_t ldy) {
  constexpr int64_t kMax = N;
  int64_t i = 0;
  for (; i + kMax <= x.m; i += kMax) tile[kMax - 1](p, x, i, y, ldy);
  if (i < x.m) tile[x.m - i - 1](p, x, i, y, ldy);
}

template <int R, int H, bool kSigned>
void panel_dot_rows(const GgufQ8Panel& p, const GgufQ8Rows& x, int64_t i0, float* y, int64_t ldy) {
  const int64_t k = x.k, nb = k / 32;
  const float* xs = H == 1 ? x.dsum : x.dsum16;
  const __m256i* pu = reinterpret_cast<const __m256i*>(p.u);
  __m256 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < p.chunks; ++j) {
    __m256i u[8], ua[8];
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      u[v] = _mm256_load_si256(pu + 8 * j + v);
      if constexpr (kSigned) ua[v] = _mm256_sign_epi8(u[v], u[v]);
    }
    const __m256 a0 = _mm256_loadu_ps(p.a + j * H * 8), c0 = _mm256_loadu_ps(p.c + j * H * 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int8_t* xb = x.q + (i0 + i) * k + 32 * j;
      __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        if constexpr (kSigned) {
          s0 = idot_acc_signed(s0, ua[v], u[v], xb + 4 * v);
          s1 = idot_acc_signed(s1, ua[v + 4], u[v + 4], xb + 16 + 4 * v);
        } else {
          s0 = idot_acc(s0, u[v], xb + 4 * v);
          s1 = idot_acc(s1, u[v + 4], xb + 16 + 4 * v);
        }
      }
      const __m256 dx = _mm256_broadcast_ss(x.d + (i0 + i) * nb + j);
      if constexpr (H == 1) {
        const __m256 s = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
        acc[i] = _mm256_fmadd_ps(s, _mm256_mul_ps(a0, dx), acc[i]);
        acc[i] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xs + (i0 + i) * nb + j), acc[i]);
      } else {
        const __m256 a1 = _mm256_loadu_ps(p.a + j * H * 8 + 8);
        const __m256 c1 = _mm256_loadu_ps(p.c + j * H * 8 + 8);
        const float* xsj = xs + (i0 + i) * 2 * nb + 2 * j;
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(a0, dx), acc[i]);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(a1, dx), acc[i]);
        acc[i] = _mm256_fmadd_ps(c0, _mm256_broadcast_ss(xsj), acc[i]);
        acc[i] = _mm256_fmadd_ps(c1, _mm256_broadcast_ss(xsj + 1), acc[i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm256_storeu_ps(y + (i0 + i) * ldy, acc[i]);
}

// Rows per register tile: AVX-512 VL has 32 vector registers, AVX2 16.
constexpr int kPanelDotRows = GGUF_X86_AVX512 ? 6 : 3;

template <int H, bool kSigned, int... R>
void panel_dot_h(const GgufQ8Panel& p, const GgufQ8Rows& x, float* y, int64_t ldy,
                 std::integer_sequence<int, R...>) {
  static constexpr PanelTileFn tile[] = {panel_dot_rows<R + 1, H, kSigned>...};
  run_row_tiles(tile, p, x, y, ldy);
}
template <int H, bool kSigned>
void panel_dot_h(const GgufQ8Panel& p, const GgufQ8Rows& x, float* y, int64_t ldy) {
  panel_dot_h<H, kSigned>(p, x, y, ldy, std::make_integer_sequence<int, kPanelDotRows>{});
}

#if GGUF_X86_AVX512
// 16-row panels (AVX-512 VNNI): R activation rows x 16 weight rows in 512-bit vectors, one
// dpbusd per 4 weights of all 16 rows (on Intel cores with two 512-bit ports twice the
// 256-bit rate: 240 against 132 GMAC/s a core, 2026-12-04). Unsigned u only (VNNI packs
// Q8_0 as q + 128).
template <int R, int H>
void panel16_dot_rows(const GgufQ8Panel& p, const GgufQ8Rows& x, int64_t i0, float* y,
                      int64_t ldy) {
  const int64_t k = x.k, nb = k / 32;
  const float* xs = H == 1 ? x.dsum : x.dsum16;
  const __m512i* pu = reinterpret_cast<const __m512i*>(p.u);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < p.chunks; ++j) {
    __m512i u[8];
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) u[v] = _mm512_load_si512(pu + 8 * j + v);
    const __m512 a0 = _mm512_loadu_ps(p.a + j * H * 16), c0 = _mm512_loadu_ps(p.c + j * H * 16);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int8_t* xb = x.q + (i0 + i) * k + 32 * j;
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
        int32_t x0, x1;
        std::memcpy(&x0, xb + 4 * v, 4);
        std::memcpy(&x1, xb + 16 + 4 * v, 4);
        s0 = _mm512_dpbusd_epi32(s0, u[v], _mm512_set1_epi32(x0));
        s1 = _mm512_dpbusd_epi32(s1, u[v + 4], _mm512_set1_epi32(x1));
      }
      const __m512 dx = _mm512_set1_ps(x.d[(i0 + i) * nb + j]);
      if constexpr (H == 1) {
        const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[i] = _mm512_fmadd_ps(s, _mm512_mul_ps(a0, dx), acc[i]);
        acc[i] = _mm512_fmadd_ps(c0, _mm512_set1_ps(xs[(i0 + i) * nb + j]), acc[i]);
      } else {
        const __m512 a1 = _mm512_loadu_ps(p.a + j * H * 16 + 16);
        const __m512 c1 = _mm512_loadu_ps(p.c + j * H * 16 + 16);
        const float* xsj = xs + (i0 + i) * 2 * nb + 2 * j;
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(a0, dx), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(a1, dx), acc[i]);
        acc[i] = _mm512_fmadd_ps(c0, _mm512_set1_ps(xsj[0]), acc[i]);
        acc[i] = _mm512_fmadd_ps(c1, _mm512_set1_ps(xsj[1]), acc[i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + (i0 + i) * ldy, acc[i]);
}

constexpr int kPanel16DotRows = 8;  // 8 weight vectors + 8 accumulators + temporaries

template <int H, int... R>
void panel16_dot_h(const GgufQ8Panel& p, const GgufQ8Rows& x, float* y, int64_t ldy,
                   std::integer_sequence<int, R...>) {
  static constexpr PanelTileFn tile[] = {panel16_dot_rows<R + 1, H>...};
  run_row_tiles(tile, p, x, y, ldy);
}
#endif

void panel_dot(const GgufQ8Panel& p, const GgufQ8Rows& x, float* y, int64_t ldy) {
#if GGUF_X86_AVX512
  if (p.cols == 16) {
    const auto rows = std::make_integer_sequence<int, kPanel16DotRows>{};
    if (p.halves == 2) return panel16_dot_h<2>(p, x, y, ldy, rows);
    return panel16_dot_h<1>(p, x, y, ldy, rows);
  }
#endif
  if (p.signed_u) return panel_dot_h<1, true>(p, x, y, ldy);
  if (p.halves == 2) return panel_dot_h<2, false>(p, x, y, ldy);
  panel_dot_h<1, false>(p, x, y, ldy);
}

void set_panel_kernels(GgufKernels& t) {
  auto set = [&](GGMLType type, GgufQ8PackFn fn) { t.q8_pack[static_cast<int>(type)] = fn; };
  set(GGMLType::kQ4_0, pack_panel<GGMLType::kQ4_0, false>);
  set(GGMLType::kQ4_1, pack_panel<GGMLType::kQ4_1, false>);
  set(GGMLType::kQ5_0, pack_panel<GGMLType::kQ5_0, false>);
  set(GGMLType::kQ5_1, pack_panel<GGMLType::kQ5_1, false>);
  set(GGMLType::kQ8_0, pack_panel<GGMLType::kQ8_0, !GGUF_X86_VNNI>);
  set(GGMLType::kQ4_K, pack_panel<GGMLType::kQ4_K, false>);
  set(GGMLType::kQ5_K, pack_panel<GGMLType::kQ5_K, false>);
  set(GGMLType::kQ6_K, pack_panel<GGMLType::kQ6_K, false>);
  t.q8_panel_dot = panel_dot;
  t.q8_panel_cols = GGUF_X86_AVX512 ? 16 : kGgufPanelCols;
}
