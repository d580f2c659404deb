// CPU kernel of causal_conv1d (depthwise causal convolution + SiLU over packed
// variable-length rows with per-request conv state) on raw buffers (no MLX).
// Equations: ops/causal_conv1d.h.
#pragma once

#include <cstdint>

#include "cpu/vec.h"

namespace vllm_metal::cpu {

struct CausalConv1dRows {
  Elt elt = Elt::kF32;
  const void* x = nullptr;        // [T, channels], row-contiguous
  const void* weight = nullptr;   // [channels, width]
  const void* bias = nullptr;     // [channels] or null
  const int32_t* cu_seqlens = nullptr;         // [num_seqs + 1]
  const int32_t* slots = nullptr;              // [num_seqs]
  const int32_t* has_initial_state = nullptr;  // [num_seqs]
  void* state = nullptr;          // [num_slots, channels, width - 1], updated at the slots
  void* out = nullptr;            // [T, channels]
  int64_t num_seqs = 0;
  int64_t channels = 0;
  int64_t width = 0;              // kernel size K, 2..8
  bool silu = true;
};

// Threaded over (sequence, block of channels); within a block the window of
// the last K-1 inputs is a ring of float rows and each tap is one 8-wide FMA
// pass over the channels.
void causal_conv1d_rows(const CausalConv1dRows& a);

}  // namespace vllm_metal::cpu
