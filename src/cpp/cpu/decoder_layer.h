// One decoder layer of the llama family (or gemma3's sandwich layout) on the CPU (no MLX):
//
//   h   = x + [attn_out_norm] o_proj(attention(rope(q_norm(q)), rope(k_norm(k)), v))
//         where q, k, v = proj(norm1(x))
//   out = h + [mlp_out_norm] down(act(gate(norm2(h))) * up(norm2(h)))
//         or, an MoE layer, h + fused_moe(norm2(h), router(norm2(h)))
//
// act is SiLU or gemma's tanh GELU; the bracketed norms are gemma3's (sandwich).
//
// It runs the very kernels the per-op model runs (rms_norm, gguf_matmul, rope,
// the cache scatter, paged_attention, silu_and_mul) and rounds to `elt` at the same
// points, so a model evaluated layer by layer gives the same numbers with one MLX
// dispatch per layer instead of ~20 (the per-node cost dominates decode on the CPU).
#pragma once

#include <cstdint>

#include "cpu/gguf_matmul.h"
#include "cpu/lora.h"
#include "cpu/paged_attention.h"
#include "cpu/silu_and_mul.h"
#include "cpu/vec.h"

namespace vllm_metal::cpu {

// A projection: its weight (block form or F32/F16/BF16) and an optional bias [n] in elt.
struct LayerLinear {
  gguf::GGMLType type = gguf::GGMLType::kF32;
  const void* w = nullptr;
  const void* bias = nullptr;
  int64_t n = 0;
  int64_t k = 0;
  // LoRA slots (cpu/lora.h), or null: A [S, R, k], B [S, n, R] in elt, scale float [S]
  const void* lora_a = nullptr;
  const void* lora_b = nullptr;
  const float* lora_scale = nullptr;
};

struct DecoderLayerRows {
  Elt elt = Elt::kF32;  // of x, out, the norms, the biases and the caches
  const void* x = nullptr;  // [tokens, hidden]
  void* out = nullptr;      // [tokens, hidden]; may be x itself
  int64_t tokens = 0;
  int64_t hidden = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  bool exact = true;  // gguf_matmul's `exact` for every projection
  // LoRA: each projection's output gets its row's adapter delta (after the bias), as
  // the per-op model's LoraLinear does; null: no adapter this step
  const int32_t* lora_row_slot = nullptr;  // [tokens], -1 = base
  int64_t lora_rank = 0;

  const void* input_norm = nullptr;  // [hidden]
  const void* post_norm = nullptr;   // [hidden]
  const void* attn_out_norm = nullptr;  // [hidden] or null (gemma3: post_attention_layernorm)
  const void* mlp_out_norm = nullptr;   // [hidden] or null (gemma3: post_feedforward_layernorm)
  float norm_eps = 1e-6f;
  GatedActivation activation = GatedActivation::kSilu;
  const void* q_norm = nullptr;  // [head_dim] or null (qwen3)
  const void* k_norm = nullptr;
  float qk_norm_eps = 1e-6f;
  LayerLinear q, k, v, o, gate, up, down;
  // A sparse MoE MLP instead when num_experts > 0 (ops/decoder_layer.h): gate, up and
  // down hold the stacked experts ([E * I] rows of k = hidden; [E * hidden] of I), run as
  // fused_moe_rows (dense) or fused_moe_gguf_rows (expert_blocks) on router(norm2(h)).
  int64_t num_experts = 0;
  int64_t top_k = 0;
  bool moe_renormalize = false;
  bool expert_blocks = false;
  LayerLinear router;

  // rope: see cpu/rope.h
  const int32_t* positions = nullptr;  // [tokens]
  const uint32_t* rope_table = nullptr;
  int64_t rotary_dim = 0;
  bool neox = true;
  float rope_mscale = 1.0f;

  // the step's keys and values go to slot_mapping (negative: skipped) of the caches,
  // [num_blocks, block_size, num_kv_heads, head_dim] each, updated in place
  const int64_t* slot_mapping = nullptr;
  void* key_cache = nullptr;
  void* value_cache = nullptr;

  // attention: q, caches, out and the head counts are filled in here; the metadata,
  // scale, window and softcap come from the caller (already checked)
  PagedAttentionParams attention;
};

// Threaded inside each kernel. Scratch is per thread and kept across calls.
void decoder_layer(const DecoderLayerRows& a);

}  // namespace vllm_metal::cpu
