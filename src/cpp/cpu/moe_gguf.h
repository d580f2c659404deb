// CPU kernel of fused_moe_gguf: routing as cpu/moe.h, then per active expert its
// slots' rows gathered and run through gguf_matmul (gate, up, down) straight from the
// expert's blocks, so every expert's weights are read once per call.
#pragma once

#include <cstdint>

#include "cpu/moe.h"
#include "cpu/vec.h"
#include "runtime/gguf_types.h"

namespace vllm_metal::cpu {

struct MoeGgufRows {
  Elt elt = Elt::kF32;            // hidden / out
  const void* x = nullptr;        // [T, H]
  const float* logits = nullptr;  // [T, E]
  const uint8_t* w_gate = nullptr;  // E * I rows of row_bytes(gate_type, H)
  const uint8_t* w_up = nullptr;
  const uint8_t* w_down = nullptr;  // E * H rows of row_bytes(down_type, I)
  gguf::GGMLType gate_type = gguf::GGMLType::kF32, up_type = gguf::GGMLType::kF32,
                 down_type = gguf::GGMLType::kF32;
  void* out = nullptr;
  int32_t* ids = nullptr;   // [T, k]
  float* weights = nullptr; // [T, k]
  int64_t num_tokens = 0, hidden = 0, num_experts = 0, inter = 0, top_k = 1;
  bool renormalize = false, sigmoid = false;
  bool exact = false;  // gguf_matmul's exact
  MoeExtras extras;
};

void fused_moe_gguf_rows(const MoeGgufRows& a);

}  // namespace vllm_metal::cpu
