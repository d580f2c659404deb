// decoder_layer: one pre-norm llama-family layer (norm, q/k/v, q/k norms, rope,
// cache write, paged attention, o_proj, residual, norm, SwiGLU MLP or sparse MoE MLP,
// residual) as a single MLX node.
//
// On the native CPU backend it runs cpu/decoder_layer.h: on MLX's CPU backend every
// node costs ~10 us of dispatch whatever its size, and a decode step of a small model
// is ~20 nodes a layer of a few microseconds of work each. On a GPU stream (Apple) and
// on the emulated backend it runs a Metal plan (ops/decoder_layer_plan.h): the fused
// kernels of src/metal/decoder_layer.metal and paged attention's kernels back to back,
// 5 dispatches a llama layer and 6 a gemma3 layer, instead of ~14 of ours plus MLX's
// elementwise ops. The fused kernels re-read the weights for every 8 rows, so models
// send only small batches (decode steps) through it on the GPU (fused_layers.py).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/utils.h"
#include "ops/kernel_primitive.h"
#include "runtime/gguf_types.h"

namespace vllm_metal {

namespace mx = mlx::core;

// What does not change from step to step. Weights are passed with each call, in
// the order of DecoderLayerSpec::weight_names().
struct DecoderLayerSpec {
  int64_t hidden = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  float norm_eps = 1e-6f;
  float qk_norm_eps = 1e-6f;
  bool qkv_bias = false;  // q, k and v each carry a bias (qwen2, llama attention_bias)
  bool o_bias = false;    // o_proj carries a bias (llama attention_bias)
  bool qk_norm = false;   // per-head RMSNorm of q and k before rope (qwen3, gemma3)
  bool sandwich = false;  // norms of the attention and MLP outputs too (gemma3)
  bool gelu = false;      // MLP activation: tanh GELU (gemma3); else SiLU
  // GGML types of q, k, v, o, gate, up, down (F32 / F16 / BF16 for dense weights)
  std::vector<gguf::GGMLType> types;
  int64_t rotary_dim = 0;
  bool neox = true;
  float rope_mscale = 1.0f;
  float scale = 1.0f;          // attention scale
  int64_t sliding_window = 0;  // 0: none
  float softcap = 0.0f;        // 0: none
  bool exact = true;           // gguf_matmul's exact
  // LoRA adapters this step (vllm_metal.lora): each projection's output gets its row's
  // delta, as lora_apply (ops/lora.h) adds it after the bias. The weights end with
  // lora_row_slot int32 [T] and, per projection p of q..down, p_lora_a [S, R, in],
  // p_lora_b [S, out, R] (x's dtype) and p_lora_scale float32 [S]. On the Metal
  // kernels such a step runs the per-op plan (lora_apply after each mat-mul).
  bool lora = false;
  // A sparse MoE MLP in place of the gated one (qwen3_moe) when num_experts > 0: the
  // router [num_experts, hidden] (type router_type) picks top_k experts per token (softmax
  // over all experts, the top_k renormalised when moe_renormalize), whose SwiGLU MLPs run
  // as fused_moe does (ops/moe.h: dense experts of types F32/F16/BF16, [E, I, H] /
  // [E, H, I]) or, expert_blocks, as fused_moe_gguf does (GGUF blocks, E * rows rows).
  // types[4..6] are the experts' and `intermediate` is the expert width I. The router's
  // logits are rounded to x's dtype first, as the per-op model's router output is.
  int64_t num_experts = 0;
  int64_t top_k = 0;
  bool moe_renormalize = false;
  bool expert_blocks = false;
  gguf::GGMLType router_type = gguf::GGMLType::kF32;
  bool moe() const { return num_experts > 0; }

  // input_norm, post_norm, q, k, v, o, gate, up, down (MoE: gate_exps, up_exps,
  // down_exps)[, attn_out_norm, mlp_out_norm][, q_bias, k_bias, v_bias][, o_bias]
  // [, q_norm, k_norm][, router][, lora_row_slot, q_lora_a, q_lora_b, q_lora_scale, ...,
  // down_lora_scale]
  std::vector<std::string> weight_names() const;
};

// x [T, hidden] float; positions int32 [T]; slot_mapping int64 [T]; block_tables,
// seq_lens, cu_seqlens_q int32 as paged_attention takes them; key/value caches
// [num_blocks, block_size, num_kv_heads, head_dim] in x's dtype, updated IN PLACE at
// eval (vLLM's KV-cache contract: buffers the runner owns; each must own its buffer
// alone, else the eval raises); rope_table uint32 [2, rotary_dim / 2]
// (rope_turn_table). Returns out [T, hidden]: the residual stream after the layer.
// The Metal plan needs paged attention's planning hints (paged_attention.h): given, or
// computed from evaluated metadata.
mx::array decoder_layer(const mx::array& x, const mx::array& positions,
                        const mx::array& slot_mapping, const mx::array& block_tables,
                        const mx::array& seq_lens, const mx::array& cu_seqlens_q,
                        const mx::array& key_cache, const mx::array& value_cache,
                        const mx::array& rope_table, const std::vector<mx::array>& weights,
                        const DecoderLayerSpec& spec,
                        std::optional<int64_t> num_decode_seqs = std::nullopt,
                        std::optional<int64_t> max_seq_len = std::nullopt,
                        std::optional<int64_t> max_query_len = std::nullopt,
                        mx::StreamOrDevice s = {});

struct DecoderLayerProblem;

class DecoderLayer : public KernelPrimitive {
 public:
  DecoderLayer(mx::Stream stream, KernelBackend backend, std::shared_ptr<DecoderLayerProblem> p);

  KernelPlan plan(const std::vector<mx::array>& inputs,
                  const std::vector<mx::array>& outputs) const override;
  const char* name() const override { return "DecoderLayer"; }

 protected:
  void allocate_outputs(const std::vector<mx::array>& inputs,
                        std::vector<mx::array>& outputs) override;
  void eval_native_cpu(const std::vector<mx::array>& inputs,
                       std::vector<mx::array>& outputs) override;

 private:
  std::shared_ptr<const DecoderLayerProblem> problem_;
};

}  // namespace vllm_metal
