// The Metal plan of decoder_layer (ops/decoder_layer.h): the fused kernels of
// src/metal/decoder_layer.metal around paged attention's own plan, back to back
// in one plan (no MLX op between them). docs/kernels.md, "Metal decoder layer plan".
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "ops/decoder_layer.h"
#include "ops/kernel_launch.h"
#include "ops/paged_attention.h"

namespace vllm_metal {

struct DecoderLayerProblem {
  DecoderLayerSpec spec;
  mx::Dtype dtype = mx::float16;  // of x, the norms, biases and caches
  int64_t tokens = 0;
  int64_t num_slots = 0;  // cache slots: num_blocks * block_size
  int64_t lora_slots = 0, lora_rank = 0;  // spec.lora: the adapter slots' count and rank
  // attention over q [tokens, num_heads, head_dim]: counts, hints, batch-invariant mode
  PagedAttentionProblem attention;
};

// Array slots of the plan: the op's inputs (x .. rope_table, the weights in
// spec.weight_names() order), then its outputs.
struct DecoderLayerSlots {
  explicit DecoderLayerSlots(const DecoderLayerSpec& spec);
  int weight(const std::string& name) const;  // -1 when the spec has no such weight

  static constexpr int kX = 0, kPositions = 1, kSlotMapping = 2, kBlockTables = 3,
                       kSeqLens = 4, kCuSeqlensQ = 5, kKeyCache = 6, kValueCache = 7,
                       kRopeTable = 8, kWeights = 9;
  std::vector<std::string> names;
  // outputs: out [T, hidden], then scratch: q [T, Hq * D], attn [T, Hq, D], h [T, hidden]
  // (the residual stream after attention), act [T, intermediate], o and d [T, hidden]
  // (the o and down projections before their norm or residual add: gemma, long batches),
  // long batches only: xn [T, hidden] (a normalised input), q/k/v_projected, up
  // [T, intermediate]; split-KV partials (3); an MoE layer's router logits [T, E] (x's
  // dtype, then float32), expert ids int32 and routing weights float32 [T, top_k], and
  // fused_moe's float32 scratch [T * top_k, I] and [T * top_k, hidden] (its xn and d are
  // the MoE input and output at every batch size). Unused ones are [0].
  int out = 0, q = 0, attn = 0, h = 0, act = 0, o = 0, d = 0, xn = 0, q_projected = 0,
      k_projected = 0, v_projected = 0, up = 0, partials = 0, logits = 0, logits_f32 = 0,
      moe_ids = 0, moe_weights = 0, moe_act = 0, moe_y = 0;
  static constexpr int kNumOutputs = 21;
};

// Shapes of the outputs (slot order from `out`); only `out` when attention.uses_kernels
// is false (the native CPU path keeps its own scratch).
std::vector<mx::Shape> decoder_layer_output_shapes(const DecoderLayerProblem& p);
std::vector<mx::Dtype> decoder_layer_output_dtypes(const DecoderLayerProblem& p);

// Whether the plan runs the fused kernels: up to 8 tokens (one pass over the weights),
// or any batch in batch-invariant mode (the per-op path then runs mat-vecs too).
// A step with LoRA adapters never fuses (the fused kernels have no delta hook).
bool decoder_layer_fuses(const DecoderLayerProblem& p);

// Fused: layer_qkv, attention (decode [+ reduce]), layer_matvec (o), layer_gate_up,
// layer_matvec (down) [, layer_add_norm (gemma)]. An MoE layer's MLP, at every batch
// size: rms_norm, the router's gguf_matmul [, layer_to_float], fused_moe(_gguf)'s plan,
// layer_add_norm (the residual add). Longer batches: the per-op kernels
// (rms_norm, the tiled gguf_matmul, attention's prefill kernel) with small epilogue
// kernels of decoder_layer.metal for what MLX ops did between them, and with LoRA
// adapters lora_apply after each mat-mul (in place on its output).
KernelPlan plan_decoder_layer(const DecoderLayerProblem& p);

}  // namespace vllm_metal
