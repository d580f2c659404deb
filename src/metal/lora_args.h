// Arguments of the lora_apply kernel, shared by the host (C++) and the shader.
#pragma once

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#else
#include <cstddef>
#include <cstdint>
#endif

// The largest adapter rank a slot may hold: h (one float per rank) lives in
// threadgroup memory. vLLM's --max-lora-rank choices stop at 512.
#define LORA_MAX_RANK 512

struct LoraApplyArgs {
  uint32_t num_rows;    // T
  uint32_t in_dim;      // columns of x
  uint32_t out_dim;     // columns of y
  uint32_t rank;        // R (slot rank; smaller adapters are zero-padded)
  uint32_t num_slots;   // S
  uint32_t pad_;
};

#ifndef __METAL_VERSION__
static_assert(sizeof(LoraApplyArgs) == 24, "LoraApplyArgs layout must match the shader");
static_assert(offsetof(LoraApplyArgs, num_slots) == 16, "LoraApplyArgs layout must match the shader");
#endif
