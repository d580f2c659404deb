// The per-instruction-set kernels behind gguf_matmul (internal to src/cpp/cpu).
//
// Decode rows (m <= 8) run integer dot products: the activations are quantized
// once per call to 8 bits per value in blocks of 32 (GgufQ8Rows), and each
// weight block is multiplied with them in integers, straight from its packed
// form; per-block float scales are applied to the integer sums. More rows on
// the integer path (x86): weight panels in bytes (GgufQ8Panel), decoded once and
// dotted with every row. Float weights (F32 / F16 / BF16) are dotted with float
// activations directly. Other prefill rows (m > 8) decode a panel of weight rows
// to float32 once and multiply it with every activation row (GgufPanelFn).
//
// One table per instruction set: portable (scalar, NEON, NEON + dotprod) in
// gguf_quants.cpp, AVX2 in gguf_dot_avx2.cpp, AVX-512 (VNNI) in
// gguf_dot_avx512.cpp (both from gguf_dot_x86.h and gguf_panel_x86.h).
// gguf_matmul.cpp picks the best the CPU runs.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_tables.h"
#include "runtime/gguf_types.h"

namespace vllm_metal::cpu {

// MXFP4's block scale: 2^(e - 128), the E8M0 exponent byte's scale halved, since the weights
// are kGgufMxfp4Values (the E2M1 values doubled, -12 .. 12). Built from its bits: a normal
// float for e >= 2, the subnormals 2^-127 / 2^-128 for e = 1 / 0.
inline float gguf_e8m0_half(uint8_t e) {
  const uint32_t bits = e >= 2 ? static_cast<uint32_t>(e - 1) << 23 : 0x00800000u >> (2 - e);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr int kGgufQ8Block = 32;  // activation values per float scale

// Activations x [m, k] as 8-bit blocks: x[i, 32b + l] ~ d[i, b] * q[i, 32b + l].
struct GgufQ8Rows {
  int64_t m = 0;
  int64_t k = 0;                  // multiple of 32
  const int8_t* q = nullptr;      // [m, k], |q| <= 127
  const float* d = nullptr;       // [m, k / 32]
  const float* dsum = nullptr;    // [m, k / 32]: d * (sum of the block's q)
  const int16_t* sum16 = nullptr; // [m, k / 16]: sum of q over each 16 values
  const float* dsum16 = nullptr;  // [m, k / 16]: d * sum16 (two-half panels); may be null
  // The x86 mat-vec kernels' forms (gguf_matmul fills them; other kernels ignore them):
  const float* dpair = nullptr;     // [m, k / 32, 2]: d and dsum of each block side by side
  const int32_t* neg_qsum = nullptr;  // [m, k / 32]: -(sum of the block's q)
};

// Quantizes x [m, k] (k a multiple of 32): per block, d = max|x| / 127 and
// q = round_half_even(x * (127 / max|x|)) (q = 0, d = 0 for an all-zero block).
using GgufQuantizeQ8Fn = void (*)(const float* x, int64_t m, int64_t k, int8_t* q, float* d,
                                  float* dsum, int16_t* sum16);

// y[i * ldy + r] = dot(weight row r, x row i) for r < rows, i < x.m (1 <= x.m <= 8);
// weight rows are row_bytes apart.
using GgufQ8DotFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t rows,
                             const GgufQ8Rows& x, float* y, int64_t ldy);

// The same for float weights (F32 / F16 / BF16) and float activations x [m, k], m <= 8.
using GgufFloatDotFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t rows,
                                const float* x, int64_t m, int64_t k, float* y, int64_t ldy);

// Prefill micro-kernel: out[i * ldo + j] (+)= dot(x row i, w row j) for i < kGgufPanelWidth,
// j < nr <= panel_rows, over k values; xp is a packed panel of 16 activation rows, [k][16]
// (zero rows pad a short panel), w holds nr float rows ldw apart. accumulate: add to out.
constexpr int kGgufPanelWidth = 16;
using GgufPanelFn = void (*)(const float* xp, const float* w, int64_t ldw, int nr, int64_t k,
                             float* out, int64_t ldo, bool accumulate);

// Prefill micro-kernel over packed weights (tables with enough vector registers, else
// null): out[i * ldo + j] (+)= dot(x row i, weight column j) for i < rows <=
// kGgufWeightPanelRows, j < kGgufWeightPanelCols, over k values; x rows are ldx floats
// apart, wp is a panel of kGgufWeightPanelCols weight rows transposed, [k][cols] (zero
// columns pad a short panel). Each output's sum runs over p in order whatever `rows` is,
// so a row's result does not depend on the rows that share its call. bias (null: none,
// else kGgufWeightPanelCols floats) is added to each stored value: out = (out +) sum + bias.
constexpr int kGgufWeightPanelCols = 32;
constexpr int kGgufWeightPanelRows = 12;
using GgufWeightPanelFn = void (*)(const float* x, int64_t ldx, int rows, const float* wp,
                                   int64_t k, float* out, int64_t ldo, bool accumulate,
                                   const float* bias);
// A weight panel from float rows: panel[p * kGgufWeightPanelCols + j] = rows[j * ld + p] for
// j < cols (<= kGgufWeightPanelCols), p < k; columns cols .. are zero.
using GgufPanelLayoutFn = void (*)(const float* rows, int64_t ld, int cols, int64_t k,
                                   float* panel);

// ---- batched integer path: weight panels ---------------------------------------------
// `cols` weight rows (8, or 16 where 512-bit dots pay) decoded once into unsigned bytes laid
// out for the integer dot instructions, then multiplied with every activation row of the
// call: chunk j (32 weights) is 8 vectors of 4 * cols bytes, vector p holding weights
// 4p .. 4p + 3 of rows 0 .. cols - 1 (row r at bytes 4r .. 4r + 3), so one 4-byte broadcast
// of x feeds every row. Weight = a_h * u + c_h per 16-weight half h of a chunk; c_h
// multiplies the activations' d * (sum of q) over that half. Types whose scales cover 32
// weights keep one half.
constexpr int kGgufPanelCols = 8;  // weight rows per panel (most tables)

struct GgufQ8Panel {
  uint8_t* u = nullptr;  // [chunks][8 vectors][cols rows][4]
  float* a = nullptr;    // [chunks][halves][cols rows]
  float* c = nullptr;    // [chunks][halves][cols rows]
  int64_t chunks = 0;    // k / 32
  int halves = 1;
  int cols = kGgufPanelCols;
  // u holds signed weights (AVX2 Q8_0, whose byte products could overflow maddubs' int16
  // pairs as unsigned): the dot takes |u| and moves the sign onto x.
  bool signed_u = false;
};

// 2 for the types whose scales cover 16 weights (Q6_K), else 1.
inline int gguf_q8_panel_halves(gguf::GGMLType t) { return t == gguf::GGMLType::kQ6_K ? 2 : 1; }

// Decodes weight rows 0 .. rows - 1 (<= p.cols; missing rows are zero) of k values into p,
// whose buffers hold at least k / 32 chunks.
using GgufQ8PackFn = void (*)(const uint8_t* w, int64_t row_bytes, int rows, int64_t k,
                              GgufQ8Panel& p);
// y[i * ldy + r] = dot(panel row r, x row i) for i < x.m, r < p.cols (two-half panels
// need x.dsum16).
using GgufQ8PanelDotFn = void (*)(const GgufQ8Panel& p, const GgufQ8Rows& x, float* y,
                                  int64_t ldy);

constexpr int kGgufNumTypeIds = 42;  // GGMLType ids are below this

struct GgufKernels {
  const char* name = "";
  GgufQuantizeQ8Fn quantize_q8 = nullptr;
  GgufQ8DotFn q8_dot[kGgufNumTypeIds] = {};       // null: no integer path for the type
  GgufFloatDotFn float_dot[kGgufNumTypeIds] = {}; // F32, F16, BF16
  // Quantized weights dotted with float x in float32 (gguf_matmul's `exact` decode rows)
  // without decoding rows to memory first; null: decode 16 rows to float, then float_dot.
  GgufFloatDotFn exact_dot[kGgufNumTypeIds] = {};
  // Batched integer path (x rounded to 8 bits, more rows than a mat-vec pass); null: the
  // mat-vec passes and float tiles serve every row count.
  GgufQ8PackFn q8_pack[kGgufNumTypeIds] = {};
  GgufQ8PanelDotFn q8_panel_dot = nullptr;
  int q8_panel_cols = kGgufPanelCols;             // weight rows per panel (GgufQ8Panel::cols)
  GgufPanelFn panel = nullptr;
  int panel_rows = 0;                             // weight rows per panel call
  GgufWeightPanelFn weight_panel = nullptr;       // preferred over `panel` where set
  GgufPanelLayoutFn lay_out_panel = nullptr;      // weight_panel's layout (both or neither)
};

// The portable tables (always present): scalar C++, and on arm64 NEON with and
// without the dotprod extension.
const GgufKernels& gguf_kernels_scalar();
#if defined(__aarch64__)
const GgufKernels& gguf_kernels_neon();
const GgufKernels& gguf_kernels_neon_dot();  // needs FEAT_DotProd
#endif
#if defined(__x86_64__)
const GgufKernels& gguf_kernels_avx2();    // needs AVX2, FMA, F16C
const GgufKernels& gguf_kernels_avx512();  // needs AVX-512 F/BW/VL/DQ and VNNI too
#endif

// ---- the scalar reference of the integer path ----------------------------------------
// Every int8-capable format is written, per 32-weight chunk, as w[l] = a[h] * q[l] + c[h]
// for the two 16-weight halves h = l / 16 with integer q (|q| <= 127): the SIMD kernels
// compute the same sums in another order.
struct GgufQ8Chunk {
  int8_t q[32];
  float a[2];
  float c[2];
};
// Chunk j (0 <= j < block_size / 32) of one block; false for types without an int path.
bool gguf_q8_chunk(gguf::GGMLType type, const uint8_t* block, int j, GgufQ8Chunk* out);

}  // namespace vllm_metal::cpu
