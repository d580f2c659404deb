#include "cpu/gguf_matmul.h"

#include <algorithm>
#include <vector>

#include "cpu/gguf_quants.h"
#include "cpu/parallel.h"

namespace vllm_metal::cpu {

namespace {

using gguf::GGMLType;

constexpr int64_t kTileRows = 16;  // weight rows decoded together on the tiled path

// ---- dot products over float32 rows -----------------------------------------

float dot_scalar(const float* a, const float* b, int64_t k) {
  float acc = 0.0f;
  for (int64_t i = 0; i < k; ++i) acc += a[i] * b[i];
  return acc;
}

// out[i * ldo + j] = dot(x[i], w[j]) for i < mr, j < nr.
void tile_scalar(const float* const* x, int mr, const float* const* w, int nr, int64_t k,
                 float* out, int64_t ldo) {
  for (int i = 0; i < mr; ++i) {
    for (int j = 0; j < nr; ++j) out[i * ldo + j] = dot_scalar(x[i], w[j], k);
  }
}

#if defined(__x86_64__)
// MR x NR register block: MR*NR accumulators + MR + NR loads stay in 16 ymm.
template <int MR, int NR>
VLLM_METAL_AVX2 void block_avx2(const float* const* x, const float* const* w, int64_t k,
                                float* out, int64_t ldo) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t p = 0;
  for (; p + 8 <= k; p += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w[j] + p);
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_loadu_ps(x[i] + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t q = p; q < k; ++q) s += x[i][q] * w[j][q];
      out[i * ldo + j] = s;
    }
  }
}

VLLM_METAL_AVX2 void tile_avx2(const float* const* x, int mr, const float* const* w, int nr,
                               int64_t k, float* out, int64_t ldo) {
  int i = 0;
  for (; i + 4 <= mr; i += 4) {
    int j = 0;
    for (; j + 2 <= nr; j += 2) block_avx2<4, 2>(x + i, w + j, k, out + i * ldo + j, ldo);
    for (; j < nr; ++j) block_avx2<4, 1>(x + i, w + j, k, out + i * ldo + j, ldo);
  }
  for (; i < mr; ++i) {
    int j = 0;
    for (; j + 4 <= nr; j += 4) block_avx2<1, 4>(x + i, w + j, k, out + i * ldo + j, ldo);
    for (; j < nr; ++j) block_avx2<1, 1>(x + i, w + j, k, out + i * ldo + j, ldo);
  }
}
#endif

#if defined(__aarch64__)
template <int MR, int NR>
void block_neon(const float* const* x, const float* const* w, int64_t k, float* out,
                int64_t ldo) {
  float32x4_t acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vdupq_n_f32(0.0f);
  int64_t p = 0;
  for (; p + 4 <= k; p += 4) {
    float32x4_t wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = vld1q_f32(w[j] + p);
    for (int i = 0; i < MR; ++i) {
      float32x4_t xv = vld1q_f32(x[i] + p);
      for (int j = 0; j < NR; ++j) acc[i][j] = vfmaq_f32(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = vaddvq_f32(acc[i][j]);
      for (int64_t q = p; q < k; ++q) s += x[i][q] * w[j][q];
      out[i * ldo + j] = s;
    }
  }
}

void tile_neon(const float* const* x, int mr, const float* const* w, int nr, int64_t k,
               float* out, int64_t ldo) {
  int i = 0;
  for (; i + 4 <= mr; i += 4) {
    int j = 0;
    for (; j + 4 <= nr; j += 4) block_neon<4, 4>(x + i, w + j, k, out + i * ldo + j, ldo);
    for (; j < nr; ++j) block_neon<4, 1>(x + i, w + j, k, out + i * ldo + j, ldo);
  }
  for (; i < mr; ++i) {
    int j = 0;
    for (; j + 4 <= nr; j += 4) block_neon<1, 4>(x + i, w + j, k, out + i * ldo + j, ldo);
    for (; j < nr; ++j) block_neon<1, 1>(x + i, w + j, k, out + i * ldo + j, ldo);
  }
}
#endif

using TileFn = void (*)(const float* const*, int, const float* const*, int, int64_t, float*,
                        int64_t);

TileFn pick_tile() {
#if defined(__x86_64__)
  if (has_avx2_fma()) return tile_avx2;
#elif defined(__aarch64__)
  return tile_neon;
#endif
  return tile_scalar;
}

template <Elt E>
void to_float(const void* src, int64_t n, float* dst) {
  auto* s = static_cast<const typename EltTraits<E>::Storage*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = EltTraits<E>::load(s + i);
}

void load_rows(Elt elt, const void* src, int64_t n, float* dst) {
  switch (elt) {
    case Elt::kF32: return to_float<Elt::kF32>(src, n, dst);
    case Elt::kF16: return to_float<Elt::kF16>(src, n, dst);
    case Elt::kBF16: return to_float<Elt::kBF16>(src, n, dst);
  }
}

void store_value(Elt elt, void* y, int64_t i, float v) {
  switch (elt) {
    case Elt::kF32: static_cast<float*>(y)[i] = v; return;
    case Elt::kF16: static_cast<uint16_t*>(y)[i] = float_to_f16(v); return;
    case Elt::kBF16: static_cast<uint16_t*>(y)[i] = float_to_bf16(v); return;
  }
}

}  // namespace

void gguf_matmul(const GgufMatmul& a) {
  const int64_t m = a.m, n = a.n, k = a.k;
  if (m == 0 || n == 0) return;
  // x as float32 rows
  std::vector<float> xbuf;
  const float* xf;
  if (a.elt == Elt::kF32) {
    xf = static_cast<const float*>(a.x);
  } else {
    xbuf.resize(m * k);
    load_rows(a.elt, a.x, m * k, xbuf.data());
    xf = xbuf.data();
  }
  std::vector<const float*> xrows(m);
  for (int64_t i = 0; i < m; ++i) xrows[i] = xf + i * k;

  const TileFn tile = pick_tile();
  const int64_t rb = gguf::row_bytes(a.type, k);
  const auto* w = static_cast<const uint8_t*>(a.w);
  const bool w_is_f32 = a.type == GGMLType::kF32;
  // Rows per task: about 64k weights keeps the hand-off cheap.
  const int64_t tile_rows = m <= kGgufMatvecMaxRows ? 4 : kTileRows;
  const int64_t tiles = (n + tile_rows - 1) / tile_rows;
  const int64_t grain = std::max<int64_t>(1, 65536 / (k * tile_rows));
  parallel_for(tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(w_is_f32 ? 0 : tile_rows * k);
    std::vector<float> out(m * tile_rows);
    const float* wrows[kTileRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r0 = t * tile_rows;
      const int nr = static_cast<int>(std::min(tile_rows, n - r0));
      for (int j = 0; j < nr; ++j) {
        const uint8_t* src = w + (r0 + j) * rb;
        if (w_is_f32) {
          wrows[j] = reinterpret_cast<const float*>(src);
        } else {
          gguf_decode_row(a.type, src, k, wbuf.data() + j * k);
          wrows[j] = wbuf.data() + j * k;
        }
      }
      tile(xrows.data(), static_cast<int>(m), wrows, nr, k, out.data(), tile_rows);
      for (int64_t i = 0; i < m; ++i) {
        for (int j = 0; j < nr; ++j) store_value(a.elt, a.y, i * n + r0 + j, out[i * tile_rows + j]);
      }
    }
  });
}

}  // namespace vllm_metal::cpu
