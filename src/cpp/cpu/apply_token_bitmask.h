// CPU kernel of apply_token_bitmask (ops/apply_token_bitmask.h) on raw row-major
// buffers (no MLX). Moves bits only: allowed values are copied, disallowed ones
// get -inf's bit pattern.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct TokenBitmaskRows {
  Elt elt = Elt::kF32;
  const void* logits = nullptr;        // [num_rows, vocab]
  void* out = nullptr;                 // [num_rows, vocab]; may be logits (in place)
  const uint32_t* bitmask = nullptr;   // [num_masked, mask_words]
  const int32_t* mask_of_row = nullptr;  // [num_rows]: bitmask row of each row, -1: none
  int64_t num_rows = 0;
  int64_t vocab = 0;
  int64_t mask_words = 0;  // >= ceil(vocab / 32)
};

// Threaded across pieces of rows (16384 tokens). Per mask word: all ones copies 32 values (nothing in
// place), zero writes 32 -infs, anything else selects per bit.
void apply_token_bitmask_rows(const TokenBitmaskRows& a);

}  // namespace vllm_metal::cpu
