// Arguments of the apply_token_bitmask kernels, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

struct TokenBitmaskArgs {
  int64_t logits_row_stride;  // elements between rows of logits
  int64_t out_row_stride;     // elements between rows of out
  int64_t mask_row_stride;    // int32 words between bitmask rows (>= ceil(vocab / 32))
  uint32_t vocab;             // tokens per row
  uint32_t in_place;          // 1: out is logits; write only the disallowed tokens
};

#ifndef __METAL_VERSION__
static_assert(sizeof(TokenBitmaskArgs) == 32, "TokenBitmaskArgs layout must match the shader");
static_assert(offsetof(TokenBitmaskArgs, mask_row_stride) == 16,
              "TokenBitmaskArgs layout must match the shader");
static_assert(offsetof(TokenBitmaskArgs, vocab) == 24,
              "TokenBitmaskArgs layout must match the shader");
static_assert(offsetof(TokenBitmaskArgs, in_place) == 28,
              "TokenBitmaskArgs layout must match the shader");
#endif
