// CPU kernel of mrope (multimodal rotary embedding, ops/mrope.h) on raw
// buffers (no MLX). cos/sin come from the rope turn table (cpu/rope.h), so
// angles are exact modulo one turn like rope's.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct MropeRows {
  Elt elt = Elt::kF32;
  const void* x = nullptr;          // [tokens, heads, head_size], row-contiguous
  void* out = nullptr;              // same shape; may be x
  const void* positions = nullptr;  // [3, tokens], int32 or int64
  bool positions_int64 = false;
  const uint32_t* table = nullptr;  // [2, rotary_dim / 2]
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t head_size = 0;
  int64_t rotary_dim = 0;
  int64_t sections[3] = {0, 0, 0};  // sum = rotary_dim / 2
  bool interleaved = false;
};

// Position stream (0 temporal, 1 height, 2 width) of rotary pair i.
int mrope_axis(int64_t i, const int64_t sections[3], bool interleaved);

// Threaded across tokens; per token cos/sin are computed for the three
// position streams once (vectorized), picked per pair and applied to every head.
void mrope_rows(const MropeRows& a);

}  // namespace vllm_metal::cpu
