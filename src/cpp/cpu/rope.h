// CPU kernel of rope (rotary position embedding) on raw buffers (no MLX).
//
// Angles are exact modulo one turn: each rotated pair i has a "turn rate"
// g_i = inv_freq_i / (2 pi) (turns per position), stored as the fraction of a
// turn in units of 2^-64 (two 32-bit words). position * g_i is then an integer
// product modulo 2^64 -- whole turns fall off -- and only the remainder,
// below a quarter turn after taking the quadrant, becomes a float. cos/sin of
// that reduced angle are float32 polynomials, so the result does not degrade
// with the position (exact for every int64 position, up to the 2^-32 turn
// resolution kept and the rounding of g_i to 64 bits). The Metal kernel
// (src/metal/rope.metal) computes the same thing the same way.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

// Fills the kernels' turn table from radians per position: table[i] is the
// low and table[half + i] the high 32-bit word of frac(inv_freq[i] / 2pi) * 2^64.
void rope_turn_table(const double* inv_freq, int64_t half, uint32_t* table);

// cos and sin (times mscale) of position * 2pi * g_i for the n pairs of a
// turn table of `half` pairs (n <= half). Vectorized like the kernel.
void rope_cos_sin(int64_t position, const uint32_t* table, int64_t half, int64_t n, float mscale,
                  float* cos_out, float* sin_out);

struct RopeRows {
  Elt elt = Elt::kF32;
  const void* x = nullptr;         // [tokens, heads, head_size] with the strides below
  void* out = nullptr;             // [tokens, heads, head_size], row-contiguous; may be x itself
  const void* positions = nullptr; // [tokens], int32 or int64
  bool positions_int64 = false;
  const uint32_t* table = nullptr; // [2, rotary_dim / 2] (rope_turn_table)
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_size = 0;
  int64_t rotary_dim = 0;          // even, <= head_size; the rest is copied
  int64_t x_token_stride = 0;      // elements
  int64_t x_head_stride = 0;       // elements
  int64_t x_dim_stride = 1;        // elements; vectorized when 1
  bool neox = true;                // pairs (i, i + rotary_dim/2); else (2i, 2i + 1)
  float mscale = 1.0f;
};

// Threaded across tokens; cos/sin computed once per token and pair and used
// for every head; AVX2/FMA when the CPU has it, NEON on arm64.
void rope_rows(const RopeRows& a);

}  // namespace vllm_metal::cpu
